"""A long-lived process's start-up heap, kept out of the cyclic garbage collector's way.

Python's collector makes a full pass (generation 2) over every container object it tracks
once the objects that survived its younger passes since the last full one reach a quarter
of those it already holds. A mesh process holds a few hundred thousand such objects from
its start alone (imported modules, torch's Python side, the tokenizer, the model's
configuration), while every step allocates small ones, some of which live just long enough
to be promoted (a plan in flight, a step's chunks). So in steady decoding a full pass came
every few seconds, and on the 2-core VM each took 40-100 ms in a stage (the whole pipeline
stalls behind it): time to first token's worst cases and a share of every window's steps
(docs/BENCHMARKS.md, "W6: the start-up heap frozen").

`freeze_startup_heap` collects once, then moves every object tracked at that point into
the collector's permanent generation (`gc.freeze`), which no later pass traverses. Objects
made afterwards are collected as before, and frozen ones are still freed when their last
reference goes: only a reference cycle among frozen objects that becomes garbage later is
never reclaimed, a bounded, one-time cost. vLLM's engine core does the same after start-up.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("stagemesh.heap")


def freeze_startup_heap(process: str) -> int:
    """Collect, then freeze every tracked object (see the module); call once the process
    has started up and before it serves, and again after a later start-up phase (a standby
    that loaded a stage). Returns how many objects are frozen in all."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of the collector's full passes", process,
             frozen)
    return frozen
