"""The garbage collector in a long-running server process: its start-up heap set aside.

CPython's cyclic collector runs a full (oldest-generation) collection whenever enough
objects have survived the younger ones, and a full collection walks every tracked object
the process holds. A stage's or a router's start-up leaves some 50,000-200,000 of them
(modules, torch's operator tables, the model's modules and configs) that live as long as
the process and are never garbage. On the 2-core CI VM a stage's full collection took about
90 ms of one core every 20 s or so of W6 decoding, a pause in which the whole pipeline
waits for that stage (docs/BENCHMARKS.md, "W6: the collector's pauses").

`freeze_startup_heap` collects once, then moves every object alive into the permanent
generation (`gc.freeze`), which no later collection walks: collections still run, and
still free any cycle made while serving, over the objects made since. SGLang's servers
(`freeze_gc`) and vLLM's workers after warm-up (`freeze_gc_heap`) do the same.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Collect, then exempt every live object from later collections (call once start-up is
    done: weights loaded, the pipeline up, before the first request). Logs and returns how
    many objects are frozen (all frozen so far, if called again)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects frozen out of the garbage collector's full "
             "collections", process, frozen)
    return frozen
