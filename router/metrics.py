"""The router's Prometheus metrics, as vLLM names and buckets them where it has the same
figure (`stagemesh_` for `vllm:`), so its dashboards read ours.

The router runs in several processes (front 0 in its own, fronts 1..N-1, the engine core),
so its metrics live in prometheus_client's multi-process store: each process records into a
directory the router made (`foundation.metrics.use_multiprocess_dir`), and the router's
`/metrics` sums them at each scrape. Metrics objects here are registered nowhere unless a
registry is given (tests read them from one).

Fronts record what clients see of a request (`FrontMetrics`); the core records the
scheduler, the steps and recoveries (`CoreMetrics`), its gauges and counters refreshed once a
second from the scheduler's own counts (nothing per token on the core's loop).
docs/OBSERVABILITY.md lists every metric.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from foundation.metrics import (
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    STEP_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)
from router.scheduler.scheduler import SchedulerStats


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for every v of `values`, with one write per bucket touched and
    one to the sum. In the multi-process store every write is a locked mmap write, and at
    --stream-interval 1 the front observes one value per token per stream. The bucket
    counts come out as observing them one by one; the sum to rounding (added once). Reads
    prometheus_client's `_sum`, `_buckets` and `_upper_bounds` (a test holds this to
    `observe`)."""
    if not values:
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(sum(values))
    bounds, buckets = histogram._upper_bounds, histogram._buckets
    for i, n in Tally(bisect_left(bounds, v) for v in values).items():  # v <= bounds[i]
        buckets[i].inc(n)


class FrontMetrics:
    """Per request, as its client sees it from the front: latencies from the request's
    arrival at the front to its streamed updates, tokens, how it ended."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from a request's arrival to its first streamed token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between a request's streamed updates after the first (one "
                             "per token at --stream-interval 1)",
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self._itl_held: list[float] | None = None  # inside `batch`
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (output tokens - 1)",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from a request's arrival to its end (finished, failed or "
                             "aborted)", buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests "
                                     "that completed", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated "
                                         "for requests, every choice (ended ones included)",
                                         registry=r)
        self.success = Counter(PREFIX + "request_success", "Choices that ended, by reason "
                               "(stop, length, abort)", ["finished_reason"], registry=r)
        self.failures = Counter(PREFIX + "request_failures", "Requests the server could not "
                                "complete, by kind (unavailable, resource_exhausted, "
                                "invalid_argument, already_exists, internal)", ["kind"],
                                registry=r)

    def observe_itl(self, seconds: float) -> None:
        """One inter-token latency: held until the end of a `batch`, else observed now."""
        if self._itl_held is not None:
            self._itl_held.append(seconds)
        else:
            self.itl.observe(seconds)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The inter-token latencies of one step's updates go to the histogram together, at
        the end (`observe_many`)."""
        held: list[float] = []
        self._itl_held = held
        try:
            yield
        finally:
            self._itl_held = None
            observe_many(self.itl, held)


class CoreMetrics:
    """The scheduler, steps and recoveries, recorded by the engine core."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry
        self.running = Gauge(PREFIX + "num_requests_running", "Sequences holding KV blocks "
                             "(one per choice)", registry=r, multiprocess_mode="mostrecent")
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Sequences waiting to be "
                             "scheduled, new or preempted", registry=r,
                             multiprocess_mode="mostrecent")
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Share of the KV blocks held by "
                              "running sequences (0-1), on the router's books", registry=r,
                              multiprocess_mode="mostrecent")
        self.in_flight = Gauge(PREFIX + "steps_in_flight", "Steps (micro-batches) sent to the "
                               "pipeline and not yet answered", registry=r,
                               multiprocess_mode="mostrecent")
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked "
                                      "up in the prefix cache", registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache", registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Sequences preempted (their KV "
                                   "freed, recomputed later)", registry=r)
        self.steps = Counter(PREFIX + "steps", "Pipeline steps planned", registry=r)
        self.step_latency = Histogram(PREFIX + "step_latency_seconds", "Per step: from its plan "
                                      "going out to its answer from the last stage",
                                      buckets=STEP_BUCKETS, registry=r)
        self.recoveries = Counter(PREFIX + "recoveries", "Times the pipeline went down (a "
                                  "stage lost) and the core began to recover", registry=r)
        self.recovery_seconds = Histogram(PREFIX + "recovery_duration_seconds", "From a "
                                          "pipeline failure to the pipeline serving again",
                                          buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self._seen = (0, 0, 0, 0)  # prefix queries, hits, preemptions, steps already counted

    def refresh(self, stats: SchedulerStats, steps: int) -> None:
        """Gauges from the scheduler's snapshot; counters by what grew since the last call."""
        kv = stats.kv
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(kv.num_used_blocks / kv.num_blocks if kv.num_blocks else 0.0)
        self.in_flight.set(stats.num_outstanding_steps)
        now = (kv.prefix_query_tokens, kv.prefix_hit_tokens, stats.num_preemptions, steps)
        for counter, new, old in zip((self.prefix_queries, self.prefix_hits, self.preemptions,
                                      self.steps), now, self._seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._seen = now
