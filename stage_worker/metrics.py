"""A stage's Prometheus metrics: where each step's time goes on this stage, its hops, its KV.

The stage leader records each step: always in a `StepWindow` (`Describe` reports its
figures), and in `StageMetrics` where the stage serves metrics on its `--metrics-port`.
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
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from foundation.metrics import PREFIX, STEP_BUCKETS

BUBBLE_WINDOW_S = 10.0
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

    `kv_blocks_used`, `kv_blocks_total` and `sequences` are read at scrape time.
    """

    def __init__(self, registry: CollectorRegistry, window: StepWindow, *,
                 layers: tuple[int, int], device: str, tp_size: int,
                 kv_blocks_used: Callable[[], float], kv_blocks_total: Callable[[], float],
                 sequences: Callable[[], float]) -> None:
        Info(P + "layers", "The stage: its layer range [start, end), device and TP size",
             registry=registry).info({"start": str(layers[0]), "end": str(layers[1]),
                                      "device": device, "tp_size": str(tp_size)})
        self.steps = Counter(P + "steps", "Steps run on this stage", registry=registry)
        self.tokens = Counter(P + "tokens", "Tokens computed on this stage (prompt and "
                              "decode rows of every step)", registry=registry)
        self.input_wait = Histogram(
            P + "input_wait_seconds", "Per step: time waiting for its input (upstream "
            "activations; run-ahead tokens on the first stage)", buckets=STEP_BUCKETS,
            registry=registry)
        self.busy = Histogram(
            P + "step_seconds", "Per step: time on this stage besides the wait for input "
            "(compute, sampling on the last stage, the send downstream)",
            buckets=STEP_BUCKETS, registry=registry)
        self.hop_send = Histogram(
            P + "hop_send_seconds", "Per step: time to hand the activations to the next "
            "stage's link, by transport", ["transport"], buckets=STEP_BUCKETS,
            registry=registry)
        self._hop_send_by: dict[str, Histogram] = {}  # hop_send's child of each transport
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
        self.steps.inc()
        self.tokens.inc(tokens)
        self.input_wait.observe(waited_s)
        self.busy.observe(busy_s)

    def sent(self, transport: str, seconds: float) -> None:
        child = self._hop_send_by.get(transport)
        if child is None:  # `labels` takes a lock and builds a key: once per transport
            child = self._hop_send_by[transport] = self.hop_send.labels(transport)
        child.observe(seconds)
