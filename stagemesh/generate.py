"""`stagemesh generate`: answer prompts on a model in this process (no services), with
timings. Drives `stage_worker.offline` directly."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from foundation.modelstore import resolve_model
from foundation.sampling_params import SamplingParams, SamplingParamsError
from foundation.tokenizer import ModelTokenizer
from stage_worker.offline import (
    LocalPipeline,
    LocalPipelineConfig,
    generate,
    resolve_device,
    resolve_dtype,
)


def generate_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stderr)
    model_dir = resolve_model(args.model)
    tokenizer = ModelTokenizer.from_dir(model_dir)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p if args.top_p is not None else 1.0,
        top_k=args.top_k if args.top_k is not None else -1,
        seed=args.seed,
    )
    try:
        params.validate(tokenizer.vocab_size, max_logprobs=20)
    except SamplingParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    texts: list[str] = list(args.prompt)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}]) if args.chat
               else tokenizer.encode(t) for t in texts]
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    blocks = sum(-(-(len(p) + args.max_tokens) // 16) for p in prompts)
    pipe = LocalPipeline(LocalPipelineConfig(model_dir, args.stages, dtype, device,
                                             num_blocks=blocks))
    started = time.monotonic()
    outputs = generate(pipe, prompts, [params] * len(prompts), args.max_tokens,
                       stop_ids=tokenizer.special.eos_ids)
    elapsed = time.monotonic() - started
    for text, out in zip(texts, outputs, strict=True):
        print(f"> {text}\n{tokenizer.decode(out)}\n")
    total = sum(len(o) for o in outputs)
    print(f"[generate] {len(prompts)} prompt(s), {total} tokens in {elapsed:.2f}s "
          f"({total / elapsed:.1f} tok/s) on {device} {dtype}, {args.stages} stage(s)",
          file=sys.stderr)
    return 0
