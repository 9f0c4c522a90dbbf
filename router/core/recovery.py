"""The pipeline's outages as the engine core sees them: since when the pipeline has been
down and why, the recovery budget that is left, and bringing the stages back.

A stage failure keeps every request (the core holds their tokens): the scheduler preempts
all sequences for recompute, and the core re-links the stages within
`CoreConfig.recovery_budget_s` of the failure. Past the budget the requests fail, new ones
are refused with the reason, and the core keeps trying in the background.
"""

from __future__ import annotations

import logging
import time

from router.metrics import CoreMetrics
from router.pipeline import Pipeline, PipelineState

log = logging.getLogger("stagemesh.core")


class Outage:
    """The current outage of `pipeline`, if any. Mutated by the core's loop only."""

    def __init__(self, pipeline: Pipeline, budget_s: float,
                 metrics: CoreMetrics | None = None) -> None:
        self.pipeline = pipeline
        self.budget_s = budget_s
        self.metrics = metrics
        self.since: float | None = None  # monotonic time of the failure; None while up
        self.reason = ""  # why the pipeline is down: the failure, then the last retry's error

    def begin(self, reason: str) -> None:
        """A stage failed (the pipeline is DOWN): the budget starts now."""
        self.since = time.monotonic()
        self.reason = reason
        if self.metrics is not None:
            self.metrics.recoveries.inc()

    @property
    def past_budget(self) -> bool:
        """Down for longer than the recovery budget (requests fail, new ones are refused)."""
        return (self.pipeline.state is not PipelineState.READY and self.since is not None
                and time.monotonic() - self.since > self.budget_s)

    async def recover(self) -> bool:
        """One try at bringing the pipeline back within the budget left (at least one try
        when it is spent); whether it is READY again. A failed try keeps its error as the
        reason."""
        assert self.since is not None, "recover() outside an outage"
        left = self.budget_s - (time.monotonic() - self.since)
        try:
            await self.pipeline.start(max(left, 0.0))
        except Exception as e:
            self.reason = str(e)
            return False
        if self.metrics is not None:
            self.metrics.recovery_seconds.observe(time.monotonic() - self.since)
        log.info("pipeline recovered after %.1fs", time.monotonic() - self.since)
        self.since = None
        return True
