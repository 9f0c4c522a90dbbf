"""What fp8 weights (`--quantization fp8`, `kernels.fp8_linear`) and an fp8 KV cache
(`--kv-cache-dtype fp8`) cost in accuracy, on real weights: the default model (or --model) in
one process (`LocalPipeline`), its projections in e4m3 with per-output-feature scales, its
K/V stored in e4m3 at unit scale, and both, against the same model unquantized.

- weight bytes of the projections;
- teacher-forced: every prompt's unquantized greedy continuation is fed back token by token,
  and each decode step's logits are compared (max and mean absolute difference, relative L2
  error, how often the top token is the same, and the mean absolute difference of the
  continuation tokens' log probabilities);
- free-running greedy decoding: how many prompts produce exactly the same tokens, and the
  mean length of the common prefix.

On CPU the quantized model runs the torch references (the weights-only contract, W8A16; K/V
widened from e4m3 where attention reads them); on CUDA, the Triton kernels (the weight
streaming one below 17 rows and the W8A8 `_scaled_mm` path above; the attention kernel
widening e4m3 K/V as it loads them).

    python -m benchmarks.fp8_accuracy --tokens 64 --out results.json
    python -m benchmarks.fp8_accuracy --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.activation_compression import PROMPTS, teacher_forced_logits
from benchmarks.report import git_revision, print_table, write_json
from foundation.modelstore import resolve_model
from foundation.tokenizer import ModelTokenizer
from stage_worker.layers.linear import LinearLayer
from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate


def projection_bytes(pipe: LocalPipeline) -> int:
    return sum(m.weight.numel() * m.weight.element_size()
               for stage in pipe.stages for m in stage.model.modules()
               if isinstance(m, LinearLayer))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", type=Path, default=Path("fp8_accuracy.json"))
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    tok = ModelTokenizer.from_dir(model_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    # name: (quantization, kv_cache_dtype)
    variants = {"none": ("none", "auto"), "fp8 weights": ("fp8", "auto"),
                "fp8 kv cache": ("none", "fp8"), "fp8 weights + kv cache": ("fp8", "fp8")}
    pipes = {name: LocalPipeline(LocalPipelineConfig(model_dir, num_blocks=512, dtype=dtype,
                                                     device=device, quantization=q,
                                                     kv_cache_dtype=kv))
             for name, (q, kv) in variants.items()}
    reference = greedy_generate(pipes["none"], prompts, args.tokens)
    ref_logits = teacher_forced_logits(pipes["none"], prompts, reference)  # type: ignore[arg-type]
    rows: list[dict[str, Any]] = []
    for name, pipe in pipes.items():
        logits = teacher_forced_logits(pipe, prompts, reference)  # type: ignore[arg-type]
        pairs = list(zip(logits, ref_logits, strict=True))
        diffs = [(a.float() - b.float()).abs() for a, b in pairs]
        targets = [torch.tensor([c[k + 1] for c in reference], device=a.device)
                   for k, (a, _) in enumerate(pairs[:-1])]
        lp_diff = [(a.float().log_softmax(-1).gather(1, t[:, None])
                    - b.float().log_softmax(-1).gather(1, t[:, None])).abs().mean().item()
                   for (a, b), t in zip(pairs, targets, strict=False)]
        free = greedy_generate(pipe, prompts, args.tokens)
        prefix = [next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w),
                       len(want)) for got, want in zip(free, reference, strict=True)]
        rows.append({
            "variant": name, "projection_MB": projection_bytes(pipe) / 1e6,
            "kv_bytes_per_token": sum(s.kv.shape.bytes_per_block for s in pipe.stages)
            // pipe.cfg.block_size,
            "max_abs_logit_diff": max(d.max().item() for d in diffs),
            "mean_abs_logit_diff": statistics.fmean(d.mean().item() for d in diffs),
            "rel_l2_err": max(((a.float() - b.float()).norm() / b.float().norm()).item()
                              for a, b in pairs),
            "same_top1": statistics.fmean((a.argmax(-1) == b.argmax(-1)).float().mean().item()
                                          for a, b in pairs),
            "mean_abs_token_logprob_diff": statistics.fmean(lp_diff),
            "greedy_identical": sum(p == args.tokens for p in prefix) / len(prefix),
            "mean_common_prefix": statistics.fmean(prefix)})
        print(rows[-1], flush=True)
    config = {"model": str(args.model), "dtype": args.dtype, "device": args.device,
              "prompts": len(prompts), "tokens": args.tokens, "revision": git_revision()}
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
