"""What the same Python costs when it runs once per step instead of in a tight loop.

A mesh process runs each piece of its per-step code once a step and then waits (a socket, a
queue, a condition). This benchmark times one fixed piece of that code, the data plane's
framing of a 73,728-byte activation message (`wire_tensor`, `encode_header`, `byte_view`),
in four settings, per call, thread CPU:

- `loop`: back to back, as a microbenchmark would;
- `after_python`: after 1.2 ms of other Python (a busy loop);
- `after_memory`: after touching 8 MiB of other memory;
- `after_sleep`: after 1.2 ms asleep, as a stage between two W6 steps.

Each figure is net of the timer's own cost, measured the same way around no work.

The ratio of `after_sleep` to `loop` is the factor by which a profile of warm code
understates what per-step code costs on the machine at hand (on the 2-core CI VM it was
about 5; see docs/BENCHMARKS.md). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.report import git_revision, print_table, python_ns_per_op, write_json
from stage_worker.dataplane.wire import byte_view, encode_header, wire_tensor

GAP_S = 0.0012  # about one W6 step at 2 stages
_JUNK = [bytearray(1 << 20) for _ in range(8)]


def _frame(x: torch.Tensor) -> None:
    """The per-message framing every TCP activation send does."""
    wire = wire_tensor(x)
    encode_header(1, [wire], 1 << 30)
    byte_view(wire)


def _gap(setting: str) -> None:
    if setting == "after_python":
        until = time.perf_counter() + GAP_S
        while time.perf_counter() < until:
            pass
    elif setting == "after_memory":
        for buf in _JUNK:
            buf[::4096] = b"\x01" * 256
    elif setting == "after_sleep":
        time.sleep(GAP_S)


def measure(setting: str, calls: int, work: Callable[[], None]) -> float:
    """Thread-CPU µs per call of `work` with `setting`'s gap before each call."""
    for _ in range(50):  # imports, first-call caches
        work()
    spent = 0
    for _ in range(calls):
        _gap(setting)
        started = time.thread_time_ns()
        work()
        spent += time.thread_time_ns() - started
    return spent / calls / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/cold-calls-{dt.date.today()}.json"))
    args = ap.parse_args()
    x = torch.zeros(32, 576)  # 73,728 bytes: W6's activations at 32 tokens, fp32
    config = {"what": "data-plane framing of one 73,728-byte message, thread CPU per call",
              "gap_s": GAP_S, "calls": args.calls, "revision": git_revision(),
              "python_ns_per_op": round(python_ns_per_op(), 1)}
    print(config)
    rows = []
    for setting in ("loop", "after_python", "after_memory", "after_sleep"):
        timer = measure(setting, args.calls, lambda: None)
        framed = measure(setting, args.calls, lambda: _frame(x))
        rows.append({"setting": setting, "us_per_call": round(framed - timer, 2),
                     "timer_us": round(timer, 2)})
    for row in rows:
        row["vs_loop"] = round(row["us_per_call"] / rows[0]["us_per_call"], 2)
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
