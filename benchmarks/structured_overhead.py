"""What structured output costs the last stage per step: the sampling step (`sample_step`,
as the stage runs it: masks built, uploaded and applied, the token ids copied back) at a
batch of B sequences, every one constrained by a JSON schema, against the same step with
no constraint, over random logits on the given device. A sequence that ends starts again,
so B stay constrained throughout. Reports ms per step (wall, host and device) and the share
spent building the masks on the host.

    python -m benchmarks.structured_overhead --model DIR --device cuda --batch 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import git_revision, print_table, write_json
from foundation.sampling_params import SamplingParams
from foundation.structured_output import ConstraintKind, StructuredOutput
from foundation.tokenizer import ModelTokenizer
from stage_worker.held_seqs import HeldSeq
from stage_worker.sampling import Sampler
from stage_worker.step_sampling import sample_step
from stage_worker.structured import GrammarMasks

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"enum": ["Paris", "London", "Rome", "Madrid"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    "score": {"type": "number"}},
    "required": ["name", "age", "city", "tags", "score"], "additionalProperties": False}


def run(masks: GrammarMasks | None, params: SamplingParams, batch: int, steps: int,
        vocab: int, eos: set[int], device: torch.device) -> dict[str, float]:
    seqs = [HeldSeq(i, [], [1], 1, 0, params) for i in range(batch)]
    next_id = batch
    sampler = Sampler()
    gen = torch.Generator(device=device).manual_seed(0)
    wall: list[float] = []
    mask_ms: list[float] = []
    if masks is not None:  # time the host's mask building inside the step
        build = masks.masks

        def timed_masks(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = build(*args)
            mask_ms.append((time.perf_counter() - t0) * 1e3)
            return out
        masks.masks = timed_masks  # type: ignore[method-assign]
    for step in range(steps + 5):
        logits = torch.randn(batch, vocab, generator=gen, device=device) * 4
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids, _ = sample_step(sampler, logits, seqs, vocab, masks).resolve()
        if step >= 5:
            wall.append((time.perf_counter() - t0) * 1e3)
        for row, token in enumerate(ids):
            seq = seqs[row]
            if token in eos:
                seqs[row] = HeldSeq(next_id, [], [1], 1, 0, params)
                next_id += 1
            else:
                seq.output_ids.append(token)
                seq.num_outputs += 1
    if masks is not None:
        masks.masks = build  # type: ignore[method-assign]
    return {"step_ms_median": statistics.median(wall), "step_ms_p99":
            sorted(wall)[int(0.99 * (len(wall) - 1))],
            "masks_ms_median": statistics.median(mask_ms[5:]) if mask_ms else 0.0,
            "sequences_finished": next_id - batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, required=True, help="a model dir (its tokenizer)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path("structured_overhead.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    tok = ModelTokenizer.from_dir(args.model)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    eos = set(tok.special.eos_ids)
    grammars = GrammarMasks(args.model, vocab)
    constrained = SamplingParams(temperature=1.0, structured=StructuredOutput(
        ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    free = SamplingParams(temperature=1.0)
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        for name, params, masks in (("none", free, None),
                                    ("json_schema", constrained, grammars)):
            row = {"batch": b, "constraint": name,
                   **run(masks, params, b, args.steps, vocab, eos, device)}
            rows.append(row)
            print(row, flush=True)
    write_json(args.out, {"model": args.model.name, "device": str(device), "vocab": vocab,
                          "threads": torch.get_num_threads(), "revision": git_revision()},
               rows)
    print_table(rows)


if __name__ == "__main__":
    main()
