"""Mixed prefill/decode steps with the piecewise CUDA graphs (`stage_worker.mixed_graphs`)
against the same steps eager, one runner, same random weights and inputs: D sequences
decoding at context C plus one prompt chunk of P tokens, the step's GPU-timeline time
(events around it, so the host's launch gaps count) and the host's time to queue it.

    python -m benchmarks.mixed_steps --shape smollm2-135m --cases 64x64,128x128,16x256 \\
        --out mixed_steps.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import git_revision, print_table, write_json
from benchmarks.runtime_vs_hf import build_models, cuda_time_ms, eager, host_ms
from benchmarks.shapes import SHAPES
from stage_worker.runner import StageRunner
from stage_worker.step_input import SeqChunk


@torch.inference_mode()
def mixed_ms(runner: StageRunner, vocab: int, decodes: int, prompt: int, ctx: int,
             steps: int) -> tuple[float, float]:
    """(median GPU-timeline ms, median host ms) of a step of `decodes` decodes at context
    `ctx` and one `prompt`-token chunk (the same prompt prefilled again each step)."""
    blocks = -(-(max(ctx + 3 * steps + 8, prompt)) // 16)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(decodes + 1)]
    ids = torch.randint(0, vocab, (decodes, ctx))
    for start in range(0, decodes, 8):
        group = range(start, min(decodes, start + 8))
        runner.execute([SeqChunk(i, 0, ctx, tables[i]) for i in group],
                       ids[list(group)].reshape(-1))
    pos = ctx
    inputs = torch.randint(0, vocab, (decodes + prompt,))

    def step() -> None:
        nonlocal pos
        chunks = [SeqChunk(i, pos, 1, tables[i]) for i in range(decodes)]
        chunks.append(SeqChunk(decodes, 0, prompt, tables[decodes]))
        runner.execute(chunks, inputs)
        pos += 1

    for _ in range(3):
        step()
    return (statistics.median(cuda_time_ms(step, steps)),
            statistics.median(host_ms(step, steps)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--cases", default="64x64,128x128,16x256",
                    help="DECODESxPROMPT,... (one prompt chunk per step)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("mixed_steps.json"))
    args = ap.parse_args()
    _, runner, cfg = build_models(args.shape, num_blocks=4096)
    assert runner.mixed_graphs is not None, "no piecewise graphs (CUDA with Triton needed)"
    rows: list[dict[str, Any]] = []
    for decodes, prompt in ((int(a), int(b)) for a, b in
                            (case.split("x") for case in args.cases.split(","))):
        row: dict[str, Any] = {"case": f"{decodes} decodes + {prompt}-token chunk",
                               "tokens": decodes + prompt}
        row["graphs_ms"], row["graphs_host_ms"] = mixed_ms(runner, cfg.vocab_size, decodes,
                                                           prompt, args.ctx, args.steps)
        with eager(runner):
            row["eager_ms"], row["eager_host_ms"] = mixed_ms(runner, cfg.vocab_size, decodes,
                                                             prompt, args.ctx, args.steps)
        row["speedup"] = row["eager_ms"] / row["graphs_ms"]
        rows.append(row)
        print(row, flush=True)
    write_json(args.out, {"shape": args.shape, "ctx": args.ctx,
                          "device": torch.cuda.get_device_name(), "revision": git_revision()},
               rows)
    print_table(rows)


if __name__ == "__main__":
    main()
