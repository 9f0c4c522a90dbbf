"""What each activation compression of a data-plane hop costs in accuracy, and saves in bytes.

The default model (or --model) split into two stages in one process (`LocalPipeline`); the
hop between them applies `compress` then `decompress` exactly as a sending and a receiving
stage do. Per mode, against the uncompressed hop:

- bytes per token on the hop;
- teacher-forced logits: every prompt's uncompressed greedy continuation is fed back
  token by token, and each decode step's logits are compared (max and mean absolute
  difference, relative L2 error, and how often the top token is the same);
- free-running greedy decoding: how many prompts produce exactly the same tokens, and the
  mean length of the common prefix.

    python -m benchmarks.activation_compression --tokens 64 --out results.json
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import git_revision, print_table, write_json
from foundation.modelstore import resolve_model
from foundation.tokenizer import ModelTokenizer
from stage_worker.dataplane.compression import Compression, compress, decompress
from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate
from stage_worker.step_input import SeqChunk

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a compiler do?",
)


class HopPipeline(LocalPipeline):
    """A local pipeline whose stage-to-stage hops go through `compress` / `decompress`."""

    mode = Compression.NONE

    def step(self, chunks: Sequence[SeqChunk], token_ids: torch.Tensor) -> torch.Tensor:
        x = token_ids
        for i, stage in enumerate(self.stages):
            if i:
                x = decompress(compress(x, self.mode), (x.shape[0], x.shape[1]), x.dtype)
            x = stage.execute(chunks, x)
        return x


def teacher_forced_logits(pipe: HopPipeline, prompts: list[list[int]],
                          continuations: list[list[int]]) -> list[torch.Tensor]:
    """Per decode step, the logits [S, V] after feeding the given continuations."""
    block = pipe.cfg.block_size
    total = [len(p) + len(c) for p, c in zip(prompts, continuations, strict=True)]
    tables, start = [], 0
    for n in total:
        blocks = -(-n // block)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    out = [pipe.step([SeqChunk(i, 0, len(p), tables[i]) for i, p in enumerate(prompts)],
                     torch.tensor([t for p in prompts for t in p]))]
    for k in range(min(len(c) for c in continuations) - 1):
        chunks = [SeqChunk(i, len(p) + k, 1, tables[i]) for i, p in enumerate(prompts)]
        out.append(pipe.step(chunks, torch.tensor([c[k] for c in continuations])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("activation_compression.json"))
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    tok = ModelTokenizer.from_dir(model_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    pipe = HopPipeline(LocalPipelineConfig(model_dir, num_stages=2, num_blocks=512))
    hidden = pipe.model_cfg.hidden_size
    torch.manual_seed(0)
    reference = greedy_generate(pipe, prompts, args.tokens)
    ref_logits = teacher_forced_logits(pipe, prompts, reference)
    rows: list[dict[str, Any]] = []
    for mode in Compression:
        pipe.mode = mode
        sample = torch.randn(1, hidden)
        nbytes = sum(t.numel() * t.element_size() for t in compress(sample, mode))
        logits = teacher_forced_logits(pipe, prompts, reference)
        diffs = [(a - b).abs() for a, b in zip(logits, ref_logits, strict=True)]
        rel = [((a - b).norm() / b.norm()).item()
               for a, b in zip(logits, ref_logits, strict=True)]
        same_top = [(a.argmax(-1) == b.argmax(-1)).float().mean().item()
                    for a, b in zip(logits, ref_logits, strict=True)]
        free = greedy_generate(pipe, prompts, args.tokens)
        prefix = []
        for got, want in zip(free, reference, strict=True):
            n = next((i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w),
                     len(want))
            prefix.append(n)
        rows.append({"mode": mode.value, "bytes_per_token": nbytes,
                     "vs_fp32": nbytes / (4 * hidden),
                     "max_abs_logit_diff": max(d.max().item() for d in diffs),
                     "mean_abs_logit_diff": statistics.fmean(d.mean().item() for d in diffs),
                     "rel_l2_err": max(rel), "same_top1": statistics.fmean(same_top),
                     "greedy_identical": sum(p == args.tokens for p in prefix) / len(prefix),
                     "mean_common_prefix": statistics.fmean(prefix)})
        print(rows[-1], flush=True)
    config = {"model": str(args.model), "stages": 2, "dtype": "float32", "device": "cpu",
              "prompts": len(prompts), "tokens": args.tokens, "revision": git_revision()}
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
