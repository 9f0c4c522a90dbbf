"""A step's inter-token latencies written to the histogram together (`FrontMetrics.batch`,
`observe_many`) leave it as observing each one does: every bucket's count, the count, and
the sum to rounding."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from foundation.metrics import TOKEN_LATENCY_BUCKETS
from router.metrics import FrontMetrics, observe_many

NAME = "stagemesh_inter_token_latency_seconds"


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value
            for m in registry.collect() if m.name == NAME for s in m.samples
            if not s.name.endswith("_created")}


def test_a_batch_leaves_the_histogram_as_one_observation_at_a_time() -> None:
    rng = random.Random(0)
    # every bucket, its bounds exactly (v <= bound counts in that bucket), and past the last
    values = [rng.uniform(0, 2 * TOKEN_LATENCY_BUCKETS[-1]) for _ in range(500)]
    values += [*TOKEN_LATENCY_BUCKETS, 0.0]
    one, many = CollectorRegistry(), CollectorRegistry()
    single, batched = FrontMetrics(one), FrontMetrics(many)
    for v in values:
        single.observe_itl(v)
    with batched.batch():
        for v in values[:300]:
            batched.observe_itl(v)
    observe_many(batched.itl, values[300:])
    want, got = _samples(one), _samples(many)
    assert want.keys() == got.keys()
    for key, value in want.items():
        if key[0].endswith("_sum"):
            assert got[key] == pytest.approx(value, rel=1e-12)
        else:
            assert got[key] == value, key
    assert want[(NAME + "_count", "")] == len(values)


def test_outside_a_batch_a_latency_is_observed_at_once() -> None:
    registry = CollectorRegistry()
    metrics = FrontMetrics(registry)
    metrics.observe_itl(0.01)
    assert _samples(registry)[(NAME + "_count", "")] == 1
    with metrics.batch():
        metrics.observe_itl(0.02)
        assert _samples(registry)[(NAME + "_count", "")] == 1  # held until the batch ends
    assert _samples(registry)[(NAME + "_count", "")] == 2
