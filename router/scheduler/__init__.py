"""The router's scheduler: continuous batching with chunked prefill, prefix reuse, preemption
by recompute, pipeline micro-batches and run-ahead, over ``kvcache``'s logical blocks.

Pure Python: imports no torch. See docs/SCHEDULER.md for the design.
"""

from router.scheduler.config import SchedulerConfig
from router.scheduler.errors import (
    AdmissionRefusedError,
    DuplicateSeqIdError,
    InvalidRequestError,
    InvalidStepResultError,
    RefusalReason,
    SchedulerError,
)
from router.scheduler.plan import CachedSeq, NewSeq, StepPlan, StepUpdate
from router.scheduler.scheduler import Scheduler, SchedulerStats
from router.scheduler.sequence import ChoiceSpec, FinishReason, SeqState

__all__ = [
    "AdmissionRefusedError",
    "CachedSeq",
    "ChoiceSpec",
    "DuplicateSeqIdError",
    "FinishReason",
    "InvalidRequestError",
    "InvalidStepResultError",
    "NewSeq",
    "RefusalReason",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerStats",
    "SeqState",
    "StepPlan",
    "StepUpdate",
]
