"""Probe, run from the repository root on the 2-core VM: a stage's per-step plan handling in
one process (no sockets). N sequences hold a 64-token prompt; each step is a decode plan
with run-ahead inputs (a new block every 16 tokens), encoded as the core encodes it, then
converted from the proto, checked and applied, as the first stage does and as the last
does (which also records the sampled tokens). Prints microseconds per step over 2,000 steps.

    python benchmarks/results/scheduler-2026-12-04/stage_plan_probe.py 32

The same file ran against a copy of the tree whose stage_worker/{plan_check,held_seqs,
convert}.py were compiled with mypyc (README.md).
"""

from __future__ import annotations

import sys
import time

from foundation.sampling_params import SamplingParams
from protos.stagemesh.stage.v1 import stage_pb2 as pb
from router.pipeline.convert import cached_batch_to_proto
from router.scheduler.plan import CachedSeq
from stage_worker.convert import plan_from_proto
from stage_worker.held_seqs import HeldSeqs
from stage_worker.plan import StageNewSeq, StagePlan
from stage_worker.plan_check import StepLimits, check_plan

STEPS, PROMPT = 2000, 64
LIMITS = StepLimits(4096, 512, 100_000, 16)


def run(n: int, first: bool) -> tuple[float, float, float]:
    """(convert, check, apply [+ record]) us per step for `n` sequences."""
    held = HeldSeqs(keep_tokens=True, builds_inputs=first)
    new = tuple(StageNewSeq(i, tuple(range(PROMPT)), PROMPT, tuple(range(i * 200, i * 200 + 5)),
                            0, PROMPT, True, SamplingParams()) for i in range(n))
    held.apply(StagePlan(0, new, (), ()))
    seqs, fed = list(range(n)), dict.fromkeys(range(n), 7)
    convert = check = apply = 0.0
    for t in range(1, STEPS):
        grows = (PROMPT + t) % 16 == 0  # a new block for every sequence
        cached = [CachedSeq(i, (i * 200 + 5 + t // 16,) if grows else (), PROMPT + t - 1, 1, (),
                            t - 1, True) for i in range(n)]
        wire = pb.StepPlan(step_id=t, cached_batch=cached_batch_to_proto(cached, True))
        msg = pb.StepPlan.FromString(wire.SerializeToString())
        a = time.perf_counter()
        plan = plan_from_proto(msg)
        b = time.perf_counter()
        if not first:
            held.note_sampling(t - 1, seqs)
        check_plan(plan, held.seqs, LIMITS, needs_tokens=first, knows_samples=not first)
        c = time.perf_counter()
        held.apply(plan, fed)
        if not first:
            held.record_sampled(t, seqs, [5] * n)
        d = time.perf_counter()
        convert, check, apply = convert + b - a, check + c - b, apply + d - c
    steps = STEPS - 1
    return convert / steps * 1e6, check / steps * 1e6, apply / steps * 1e6


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    for first in (True, False):
        times = ", ".join(f"{x:.1f}" for x in run(n, first))
        print(f"{n} sequences, {'first' if first else 'last'} stage: convert, check, apply "
              f"us per step: {times}")
