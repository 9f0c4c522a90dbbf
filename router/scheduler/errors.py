"""Typed errors of the scheduler; the mesh maps each to one status code at the edge."""

from __future__ import annotations

from enum import Enum


class SchedulerError(Exception):
    """Base of the scheduler's errors."""


class RefusalReason(Enum):
    """Which admission limit a refused request hit."""

    QUEUED_REQUESTS = "queued requests"
    QUEUED_TOKENS = "queued prompt tokens"


class AdmissionRefusedError(SchedulerError):
    """The queue is full; retry later (RESOURCE_EXHAUSTED, HTTP 429).

    Attributes:
        reason: the limit hit.
        limit: its configured value.
        current: the queue's figure before this request.
        requested: what this request would add.
    """

    def __init__(self, reason: RefusalReason, limit: int, current: int, requested: int) -> None:
        self.reason = reason
        self.limit = limit
        self.current = current
        self.requested = requested
        super().__init__(f"server busy: {current} {reason.value} queued, this request adds "
                         f"{requested}, the limit is {limit}")


class InvalidRequestError(SchedulerError, ValueError):
    """The request can never run as given (INVALID_ARGUMENT, HTTP 400)."""


class DuplicateSeqIdError(SchedulerError, ValueError):
    """A sequence id is repeated or already live: a bug in the caller's id allocation."""


class InvalidStepResultError(SchedulerError):
    """A step result does not match its plan (a token missing, unexpected or out of order).

    A protocol error between router and last stage; ``update`` raised before changing anything.
    """
