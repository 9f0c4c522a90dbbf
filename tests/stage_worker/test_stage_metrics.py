"""`StageMetrics` holds each step's figures and publishes them in batches: a scrape sees
every step recorded before it, as if each had been observed on its own, and no more than
`PUBLISH_STEPS` steps are ever held."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from foundation.metrics import STEP_BUCKETS
from stage_worker.metrics import PUBLISH_STEPS, StageMetrics, StepWindow


def _stage_metrics(registry: CollectorRegistry) -> StageMetrics:
    return StageMetrics(registry, StepWindow(), layers=(0, 4), device="cpu", tp_size=1,
                        kv_blocks_used=lambda: 3, kv_blocks_total=lambda: 8,
                        sequences=lambda: 1)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples
            if not s.name.endswith("_created")}


def _reference(steps: list[tuple[int, float, float]], sends: list[tuple[str, float]]
               ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The same figures observed one at a time, as before they were held."""
    r = CollectorRegistry()
    p = "stagemesh_stage_"
    count, tokens = Counter(p + "steps", "", registry=r), Counter(p + "tokens", "", registry=r)
    wait = Histogram(p + "input_wait_seconds", "", buckets=STEP_BUCKETS, registry=r)
    busy = Histogram(p + "step_seconds", "", buckets=STEP_BUCKETS, registry=r)
    hop = Histogram(p + "hop_send_seconds", "", ["transport"], buckets=STEP_BUCKETS, registry=r)
    for n, waited, spent in steps:
        count.inc()
        tokens.inc(n)
        wait.observe(waited)
        busy.observe(spent)
    for transport, seconds in sends:
        hop.labels(transport).observe(seconds)
    return _samples(r)


def _per_step(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]],
                                                   float]:
    keep = ("stagemesh_stage_steps", "stagemesh_stage_tokens", "stagemesh_stage_input_wait",
            "stagemesh_stage_step_seconds", "stagemesh_stage_hop_send")
    return {k: v for k, v in _samples(registry).items() if k[0].startswith(keep)}


def _assert_same(got: dict[tuple[str, tuple[tuple[str, str], ...]], float],
                 want: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():  # sums are added once: equal to rounding
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def test_a_scrape_sees_every_step_recorded_before_it() -> None:
    registry = CollectorRegistry()
    metrics = _stage_metrics(registry)
    steps = [(i % 7 + 1, 1e-5 * (i % 13), 3e-4 * (i % 5) + 1e-6) for i in range(PUBLISH_STEPS + 9)]
    sends = [("tcp" if i % 3 else "cuda_ipc", 2e-4 * (i % 4)) for i in range(len(steps))]
    for (n, waited, busy), (transport, seconds) in zip(steps, sends, strict=True):
        metrics.sent(transport, seconds)
        metrics.step(n, waited, busy)
    _assert_same(_per_step(registry), _reference(steps, sends))
    text = generate_latest(registry).decode()  # the exposition path publishes too
    assert f"stagemesh_stage_steps_total {float(len(steps))}" in text
    assert "stagemesh_stage_kv_blocks_used 3.0" in text


def test_steps_are_published_in_batches_without_a_scrape() -> None:
    registry = CollectorRegistry()
    metrics = _stage_metrics(registry)
    for _ in range(PUBLISH_STEPS - 1):
        metrics.step(1, 0.0, 1e-4)
    assert metrics.steps._value.get() == 0  # held
    metrics.step(1, 0.0, 1e-4)
    assert metrics.steps._value.get() == PUBLISH_STEPS  # the batch went out whole


def test_steps_recorded_while_scrapes_run_are_all_counted() -> None:
    registry = CollectorRegistry()
    metrics = _stage_metrics(registry)
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            generate_latest(registry)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for i in range(5_000):
            metrics.step(2, 0.0, 1e-4 * (i % 3))
    finally:
        done.set()
        scraper.join()
    assert _samples(registry)[("stagemesh_stage_steps_total", ())] == 5_000
    assert _samples(registry)[("stagemesh_stage_tokens_total", ())] == 10_000


def test_the_registry_knows_the_held_metrics_names() -> None:
    registry = CollectorRegistry()
    _stage_metrics(registry)
    only = registry.restricted_registry(["stagemesh_stage_steps_total"])
    assert [family.name for family in only.collect()] == ["stagemesh_stage_steps"]
