"""The kernel's CPU scheduling policy for the processes `stagemesh serve` starts.

A step of the mesh passes through several processes in turn (the engine core, the stages,
the fronts). When they outnumber the machine's cores, each message one of them sends wakes
another that, under Linux's default policy (`SCHED_OTHER`), preempts whatever runs on that
core at once: the sender is cut off mid-step, and both pay the switch and each other's cold
caches. Under `SCHED_BATCH` a woken thread does not preempt the running one; it runs when
that one blocks or its slice ends, and then usually finds more work queued, so the mesh
makes fewer switches and wake-ups for the same steps. Priorities (nice values) are unchanged.

On the 2-core VM, W6 (2 stages, 64 sequences, stream interval 16) ran 13 % more steps a
second batched: its processes were preempted about 3 times a step instead of 8.5, woke 14
times instead of 17.5 and spent 11 % less CPU a step, and new requests' times to first
token were lower too (docs/BENCHMARKS.md, "W6: the mesh's processes under SCHED_BATCH").
With cores to spare a woken thread finds an idle one and the policy changes nothing, so
`auto` keeps the default there.

The policy is set on the calling thread; the threads and processes it starts afterwards
inherit it, so `serve` sets it before it starts anything. A process started on its own
(`stagemesh router`, `stagemesh stage`) keeps the policy it was started with: `chrt -b 0`
gives it `SCHED_BATCH`.
"""

from __future__ import annotations

import os
from typing import Literal

CpuPolicy = Literal["normal", "batch"]
CHOICES = ("auto", "normal", "batch")


def choose(asked: str, busy_processes: int, cores: int) -> CpuPolicy:
    """The policy for `asked` (one of CHOICES): `auto` is batch when the processes that
    work on every step outnumber the cores they may run on, else normal."""
    if asked == "auto":
        return "batch" if busy_processes > cores else "normal"
    if asked not in ("normal", "batch"):
        raise ValueError(f"cpu policy {asked!r}: expected one of {', '.join(CHOICES)}")
    return "batch" if asked == "batch" else "normal"


def supported() -> bool:
    """Whether this platform has the policies (Linux)."""
    return hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH")


def apply(policy: CpuPolicy) -> None:
    """Set the calling thread's policy (what it starts later inherits it).

    Raises:
        OSError: the platform has no SCHED_BATCH (check `supported` first), or the kernel
            refused the change.
    """
    if not supported():
        raise OSError("this platform has no SCHED_BATCH/SCHED_OTHER scheduling policies "
                      "(Linux only); use --cpu-policy normal")
    which = os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER
    os.sched_setscheduler(0, which, os.sched_param(0))
