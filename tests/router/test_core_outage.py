"""The engine core's view of an outage: the recovery budget counts from the failure, a
failed try keeps its error as the reason, a successful one ends the outage and records how
long it lasted."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from router.core.recovery import Outage
from router.metrics import PREFIX, CoreMetrics
from router.pipeline import PipelineState


class _Pipeline:
    """Stands in for `Pipeline`: a state, and `start` that fails while `errors` last."""

    def __init__(self, errors: list[str]) -> None:
        self.state = PipelineState.DOWN
        self.errors = errors
        self.budgets: list[float] = []

    async def start(self, budget_s: float) -> None:
        self.budgets.append(budget_s)
        if self.errors:
            raise RuntimeError(self.errors.pop(0))
        self.state = PipelineState.READY


def test_the_budget_runs_from_the_failure_and_a_failed_try_names_the_reason() -> None:
    pipeline = _Pipeline(["stage 1 unreachable"])
    registry = CollectorRegistry()
    metrics = CoreMetrics(registry)
    outage = Outage(pipeline, budget_s=0.2, metrics=metrics)  # type: ignore[arg-type]
    assert not outage.past_budget  # never down
    outage.begin("stage 1 lost")
    assert (outage.reason, outage.past_budget) == ("stage 1 lost", False)
    assert not asyncio.run(outage.recover())
    assert outage.reason == "stage 1 unreachable" and 0.0 < pipeline.budgets[0] <= 0.2
    time.sleep(0.25)
    assert outage.past_budget
    assert asyncio.run(outage.recover())  # spent: still one try, with no budget left
    assert pipeline.budgets[1] == 0.0
    assert outage.since is None and not outage.past_budget
    assert registry.get_sample_value(f"{PREFIX}recoveries_total") == 1
    assert registry.get_sample_value(f"{PREFIX}recovery_duration_seconds_sum") >= 0.25


def test_a_ready_pipeline_is_never_past_its_budget() -> None:
    pipeline = _Pipeline([])
    outage = Outage(pipeline, budget_s=0.0)  # type: ignore[arg-type]
    outage.begin("a hung step")
    time.sleep(0.01)
    assert outage.past_budget
    pipeline.state = PipelineState.READY  # back, before the core's loop saw it
    assert not outage.past_budget
