"""Router scheduler overhead: ``schedule()`` plus ``update()`` per step, pure Python.

Keeps a steady set of running decodes (prompts of staggered lengths prefilled first, prefix
caching on, nothing finishes during the timed steps) and times both calls of every step with
``perf_counter_ns``. Building the fake result dict is outside the timed region: it is the
stage's work. Each case runs ``--repeats`` times and keeps the run with the lowest mean (as
``timeit`` does: other load only ever adds time). Usage:

    python -m benchmarks.bench_scheduler [--seqs 256] [--steps 2000] [--repeats 3] [--out PATH]

Target: <= 250 us per step with 256 running decodes at P = 1 on the 2-core dev machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.report import git_revision, print_table, python_ns_per_op, write_json
from kvcache import KVCacheConfig
from router.scheduler import Scheduler, SchedulerConfig, StepPlan

TARGET_US = 250.0


def _fake_result(plan: StepPlan, step: int) -> dict[int, int]:
    return {seq_id: (seq_id * 31 + step) % 32000 for seq_id in plan.sampling_seq_ids}


def _build(num_seqs: int, prompt_len: int, steps: int, pipeline: int, run_ahead: bool,
           block_size: int) -> Scheduler:
    max_len = prompt_len + block_size + steps + 64
    blocks = num_seqs * (-(-max_len // block_size) + 1)
    config = SchedulerConfig(max_num_batched_tokens=max(8192, num_seqs),
                             max_num_seqs=-(-num_seqs // pipeline), max_model_len=max_len,
                             max_inflight_steps=pipeline, run_ahead=run_ahead)
    scheduler = Scheduler(config, KVCacheConfig(num_blocks=blocks, block_size=block_size))
    for seq_id in range(num_seqs):
        # Lengths staggered over a block, so block boundaries do not all fall on one step.
        length = prompt_len + seq_id % block_size
        prompt = [(seq_id * 7919 + i) % 32000 for i in range(length)]
        scheduler.add_request(seq_id, prompt, sampling=None)
    return scheduler


def _prefill(scheduler: Scheduler, inflight: list[StepPlan], num_seqs: int) -> None:
    """Run steps until every sequence runs, then a few more so that all of them decode."""
    step = 0
    while scheduler.num_running < num_seqs or scheduler.num_waiting:
        step = _one_step(scheduler, inflight, step, timings=None)
    for _ in range(8 * scheduler.config.max_outstanding_steps):
        step = _one_step(scheduler, inflight, step, timings=None)


def _one_step(scheduler: Scheduler, inflight: list[StepPlan], step: int,
              timings: list[tuple[int, int, int]] | None) -> int:
    """Plan while there is capacity, then answer the oldest step (the pipeline's rhythm)."""
    t0 = time.perf_counter_ns()
    plan = scheduler.schedule()
    t1 = time.perf_counter_ns()
    if plan is not None:
        inflight.append(plan)
    if inflight and (plan is None or not scheduler.has_capacity):
        done = inflight.pop(0)
        result = _fake_result(done, step)
        t2 = time.perf_counter_ns()
        scheduler.update(done.step_id, result)
        t3 = time.perf_counter_ns()
    else:
        t2 = t3 = 0
    if timings is not None and plan is not None:
        timings.append((t1 - t0, t3 - t2, len(plan.cached_seqs) + len(plan.new_seqs)))
    return step + 1


def run_case(num_seqs: int, steps: int, pipeline: int, run_ahead: bool, prompt_len: int,
             block_size: int) -> dict[str, Any]:
    """Time ``steps`` steps of one configuration; returns one table row."""
    scheduler = _build(num_seqs, prompt_len, steps, pipeline, run_ahead, block_size)
    inflight: list[StepPlan] = []
    _prefill(scheduler, inflight, num_seqs)
    timings: list[tuple[int, int, int]] = []
    gc.collect()
    gc.disable()
    try:
        step = 0
        while len(timings) < steps:
            step = _one_step(scheduler, inflight, step, timings)
    finally:
        gc.enable()
    totals = sorted((s + u) / 1e3 for s, u, _ in timings)
    per_step = statistics.fmean(totals)
    return {
        "P": pipeline, "run_ahead": run_ahead, "running": num_seqs,
        "seqs/step": round(statistics.fmean(n for _, _, n in timings), 1),
        "us/step": round(per_step, 1),
        "p50_us": round(totals[len(totals) // 2], 1),
        "p99_us": round(totals[int(len(totals) * 0.99)], 1),
        "schedule_us": round(statistics.fmean(s for s, _, _ in timings) / 1e3, 1),
        "update_us": round(statistics.fmean(u for _, u, _ in timings) / 1e3, 1),
        "us/seq": round(per_step / statistics.fmean(n for _, _, n in timings), 3),
        "preemptions": scheduler.stats().num_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256, help="running decodes")
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per case")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; best kept")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/scheduler-<date>.json)")
    args = parser.parse_args()
    out = args.out or Path(__file__).parent / "results" / f"scheduler-{dt.date.today()}.json"
    config = {"seqs": args.seqs, "steps": args.steps, "prompt_len": args.prompt_len,
              "block_size": args.block_size, "prefix_caching": True,
              "python": platform.python_version(), "machine": platform.machine(),
              "processor": platform.processor() or platform.machine(),
              "repeats": args.repeats, "target_us_per_step": TARGET_US,
              "load_average_1min": round(os.getloadavg()[0], 2), "revision": git_revision(),
              "python_ns_per_op": round(python_ns_per_op(), 1)}
    print("scheduler benchmark:", ", ".join(f"{k}={v}" for k, v in config.items()))
    rows = [
        min((run_case(args.seqs, args.steps, p, ra, args.prompt_len, args.block_size)
             for _ in range(max(1, args.repeats))), key=lambda row: row["us/step"])
        for p, ra in ((1, False), (1, True), (2, False), (4, False), (4, True))
    ]
    print_table(rows)
    headline = rows[0]["us/step"]
    verdict = "meets" if headline <= TARGET_US else "MISSES"
    print(f"P=1, {args.seqs} decodes: {headline} us/step ({verdict} the {TARGET_US:g} us target)")
    write_json(out, config, rows)


if __name__ == "__main__":
    main()
