"""A stage's Prometheus metrics: where each step's time goes on this stage, its hops, its KV.

The stage leader records each step: always in a `StepWindow` (`Describe` reports its
figures), and in `StageMetrics` where the stage serves metrics on its `--metrics-port`.
`StageMetrics` holds a step's figures in a list and publishes them to Prometheus in batches
(every `PUBLISH_STEPS` steps, and before each scrape): five locked Prometheus writes a step
on the step thread cost as much as a tenth of a control-plane step.
Per step: the wait for its input (upstream activations, or run-ahead tokens on the first
stage), the time it spent on the stage besides that wait (compute, sampling, the send), and
the send of its activations to the next stage by transport. The pipeline bubble is the
share of wall time the stage waited for input: over the last `BUBBLE_WINDOW_S` (the gauge,
`Describe`), and `rate()` of the wait histogram's sum in Prometheus.
docs/OBSERVABILITY.md lists every metric.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import Metric

from foundation.metrics import PREFIX, STEP_BUCKETS, observe_many

BUBBLE_WINDOW_S = 10.0
PUBLISH_STEPS = 64  # held steps published at once (a scrape publishes whatever is held)
P = PREFIX + "stage_"


class StepWindow:
    """The stage's last BUBBLE_WINDOW_S of steps, for `Describe` and the bubble gauge: steps
    run, mean step time besides the wait for input, and the share of wall time waited.
    Kept whether or not the stage serves metrics (a deque entry per step)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._steps: deque[tuple[float, float, float]] = deque()  # (end, waited, busy)
        self._first: float | None = None
        self.total = 0  # steps since start
        self._lock = threading.Lock()

    def add(self, waited_s: float, busy_s: float) -> None:
        now = self._clock()
        with self._lock:
            self.total += 1
            if self._first is None:
                self._first = now - waited_s - busy_s
            self._steps.append((now, waited_s, busy_s))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - BUBBLE_WINDOW_S:
            self._steps.popleft()

    def snapshot(self) -> tuple[float, float]:
        """(mean busy seconds per step, waited / wall) over the window; (0, 0) when no step
        ended in it. The window starts no earlier than the first step."""
        now = self._clock()
        with self._lock:
            self._trim(now)
            if not self._steps or self._first is None:
                return 0.0, 0.0
            waited = sum(w for _, w, _ in self._steps)
            busy = sum(b for _, _, b in self._steps) / len(self._steps)
            wall = min(BUBBLE_WINDOW_S, now - self._first)
        return busy, (min(1.0, waited / wall) if wall > 0 else 0.0)


class StageMetrics:
    """The metrics of one stage process (TP rank 0 records for the whole TP group).

    `kv_blocks_used`, `kv_blocks_total` and `sequences` are read at scrape time. The
    per-step counters and histograms are registered through one collector that publishes
    the held steps first, so a scrape sees every step that ended before it.
    """

    def __init__(self, registry: CollectorRegistry, window: StepWindow, *,
                 layers: tuple[int, int], device: str, tp_size: int,
                 kv_blocks_used: Callable[[], float], kv_blocks_total: Callable[[], float],
                 sequences: Callable[[], float]) -> None:
        Info(P + "layers", "The stage: its layer range [start, end), device and TP size",
             registry=registry).info({"start": str(layers[0]), "end": str(layers[1]),
                                      "device": device, "tp_size": str(tp_size)})
        self.steps = Counter(P + "steps", "Steps run on this stage", registry=None)
        self.tokens = Counter(P + "tokens", "Tokens computed on this stage (prompt and "
                              "decode rows of every step)", registry=None)
        self.input_wait = Histogram(
            P + "input_wait_seconds", "Per step: time waiting for its input (upstream "
            "activations; run-ahead tokens on the first stage)", buckets=STEP_BUCKETS,
            registry=None)
        self.busy = Histogram(
            P + "step_seconds", "Per step: time on this stage besides the wait for input "
            "(compute, sampling on the last stage, the send downstream)",
            buckets=STEP_BUCKETS, registry=None)
        self.hop_send = Histogram(
            P + "hop_send_seconds", "Per step: time to hand the activations to the next "
            "stage's link, by transport", ["transport"], buckets=STEP_BUCKETS,
            registry=None)
        self._hop_send_by: dict[str, Histogram] = {}  # hop_send's child of each transport
        # Held until published: (tokens, waited_s, busy_s) per step, (transport, s) per send.
        self._held_steps: list[tuple[int, float, float]] = []
        self._held_sends: list[tuple[str, float]] = []
        self._lock = threading.Lock()  # the step thread holds; a scrape's thread publishes
        registry.register(_PublishFirst(
            self.publish, (self.steps, self.tokens, self.input_wait, self.busy, self.hop_send)))
        self.bubble = Gauge(P + "bubble_fraction", "Share of the last 10 s this stage "
                            "waited for input (0 when it ran no step)", registry=registry)
        self.bubble.set_function(lambda: window.snapshot()[1])
        for name, help_text, read in (
                ("kv_blocks_used", "KV blocks referenced by sequences held here",
                 kv_blocks_used),
                ("kv_blocks_total", "KV blocks in this stage's pool", kv_blocks_total),
                ("sequences", "Sequences with state on this stage", sequences)):
            Gauge(P + name, help_text, registry=registry).set_function(read)

    def step(self, tokens: int, waited_s: float, busy_s: float) -> None:
        """One step ran: `tokens` rows, `waited_s` for its input, `busy_s` besides."""
        with self._lock:
            held = self._held_steps
            held.append((tokens, waited_s, busy_s))
            if len(held) < PUBLISH_STEPS:
                return
            self._publish()

    def sent(self, transport: str, seconds: float) -> None:
        """A step's activations went to the next stage over `transport` in `seconds`."""
        with self._lock:
            self._held_sends.append((transport, seconds))

    def publish(self) -> None:
        """Any thread: the held figures into the Prometheus metrics."""
        with self._lock:
            self._publish()

    def _publish(self) -> None:
        """Under the lock (held while writing: a scrape sees all of a batch or none)."""
        steps, self._held_steps = self._held_steps, []
        sends, self._held_sends = self._held_sends, []
        if steps:
            self.steps.inc(len(steps))
            self.tokens.inc(sum(tokens for tokens, _, _ in steps))
            observe_many(self.input_wait, [waited for _, waited, _ in steps])
            observe_many(self.busy, [busy for _, _, busy in steps])
        by_transport: dict[str, list[float]] = {}
        for transport, seconds in sends:
            by_transport.setdefault(transport, []).append(seconds)
        for transport, values in by_transport.items():
            child = self._hop_send_by.get(transport)
            if child is None:  # `labels` takes a lock and builds a key: once per transport
                child = self._hop_send_by[transport] = self.hop_send.labels(transport)
            observe_many(child, values)


class _PublishFirst:
    """A collector of `metrics` that runs `publish` before collecting them (registered in
    their place, so the registry knows their names)."""

    def __init__(self, publish: Callable[[], None],
                 metrics: Iterable[Counter | Histogram]) -> None:
        self._publish = publish
        self._metrics = tuple(metrics)

    def describe(self) -> list[Metric]:
        return [m for metric in self._metrics for m in metric.describe()]

    def collect(self) -> Iterator[Metric]:
        self._publish()
        for metric in self._metrics:
            yield from metric.collect()
