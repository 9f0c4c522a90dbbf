"""Latencies held and written to a histogram in batches (a front's inter-token latencies,
`FrontMetrics.observe_itl`; the engine core's step latencies, `CoreMetrics.observe_step`;
both through `observe_many`) leave it as observing each value does: every bucket's count,
the count, and the sum to rounding; and nothing stays held past its batch, its second or
its request."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

import foundation.metrics
from foundation.metrics import TOKEN_LATENCY_BUCKETS, observe_many
from router.metrics import (
    PUBLISH_LATENCIES,
    PUBLISH_PERIOD_S,
    PUBLISH_STEPS,
    CoreMetrics,
    FrontMetrics,
)

NAME = "stagemesh_inter_token_latency_seconds"
STEPS = "stagemesh_step_latency_seconds"


def _samples(registry: CollectorRegistry, name: str = NAME) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value
            for m in registry.collect() if m.name == name for s in m.samples
            if not s.name.endswith("_created")}


def test_a_batch_leaves_the_histogram_as_one_observation_at_a_time() -> None:
    rng = random.Random(0)
    # every bucket, its bounds exactly (v <= bound counts in that bucket), and past the last
    values = [rng.uniform(0, 2 * TOKEN_LATENCY_BUCKETS[-1]) for _ in range(500)]
    values += [*TOKEN_LATENCY_BUCKETS, 0.0]
    one, many = CollectorRegistry(), CollectorRegistry()
    single, batched = FrontMetrics(one), FrontMetrics(many)
    for v in values:
        single.itl.observe(v)
    for v in values[:300]:
        batched.observe_itl(v)
    batched.publish_itls()
    observe_many(batched.itl, values[300:])
    want, got = _samples(one), _samples(many)
    assert want.keys() == got.keys()
    for key, value in want.items():
        if key[0].endswith("_sum"):
            assert got[key] == pytest.approx(value, rel=1e-12)
        else:
            assert got[key] == value, key
    assert want[(NAME + "_count", "")] == len(values)


def test_a_fronts_latencies_are_held_then_written_whole(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    registry = CollectorRegistry()
    metrics = FrontMetrics(registry)
    count = (NAME + "_count", "")
    now = [100.0]
    monkeypatch.setattr(foundation.metrics.time, "monotonic", lambda: now[0])
    metrics.publish_itls()  # the clock starts here
    for _ in range(PUBLISH_LATENCIES - 1):
        metrics.observe_itl(0.01)
    metrics.publish_itls_due()
    assert _samples(registry)[count] == 0  # held: less than a second since the last write
    metrics.observe_itl(0.02)
    assert _samples(registry)[count] == PUBLISH_LATENCIES  # a whole batch goes at once
    metrics.observe_itl(0.03)
    now[0] += PUBLISH_PERIOD_S
    metrics.publish_itls_due()  # a step's outputs a second later write what is held
    assert _samples(registry)[count] == PUBLISH_LATENCIES + 1
    metrics.observe_itl(0.04)
    metrics.publish_itls()  # a request's end (`note_end`)
    assert _samples(registry)[count] == PUBLISH_LATENCIES + 2


def test_the_cores_step_latencies_are_held_then_written_whole() -> None:
    registry = CollectorRegistry()
    metrics = CoreMetrics(registry)
    count = ("stagemesh_step_latency_seconds_count", "")
    for i in range(PUBLISH_STEPS - 1):
        metrics.observe_step(1e-3 * (i % 9))
    assert _samples(registry, STEPS)[count] == 0  # held
    metrics.observe_step(0.002)
    assert _samples(registry, STEPS)[count] == PUBLISH_STEPS  # the batch, whole
    metrics.observe_step(0.5)
    metrics.observe_step(0.25, idle=True)  # the last step in flight answered: all written
    got = _samples(registry, STEPS)
    assert got[count] == PUBLISH_STEPS + 2
    assert got[("stagemesh_step_latency_seconds_bucket", "0.25")] == PUBLISH_STEPS + 1
    metrics.observe_step(0.001)
    metrics.publish_steps()  # the core's once-a-second refresh
    assert _samples(registry, STEPS)[count] == PUBLISH_STEPS + 3
