"""The router's Prometheus metrics, as vLLM names and buckets them where it has the same
figure (`stagemesh_` for `vllm:`), so its dashboards read ours.

The router runs in several processes (front 0 in its own, fronts 1..N-1, the engine core),
so its metrics live in prometheus_client's multi-process store: each process records into a
directory the router made (`foundation.metrics.use_multiprocess_dir`), and the router's
`/metrics` sums them at each scrape. Metrics objects here are registered nowhere unless a
registry is given (tests read them from one).

Fronts record what clients see of a request (`FrontMetrics`); the core records the
scheduler, the steps and recoveries (`CoreMetrics`), its gauges and counters refreshed once a
second from the scheduler's own counts (nothing per token on the core's loop). What comes
once per step or per token (inter-token and step latencies) is held in a list and written
in batches: every write to the multi-process store is a locked mmap write.
docs/OBSERVABILITY.md lists every metric.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from foundation.metrics import (
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    STEP_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    HeldObservations,
)
from router.scheduler.scheduler import SchedulerStats

PUBLISH_STEPS = 64  # step latencies the core holds at most before writing them
PUBLISH_LATENCIES = 512  # inter-token latencies a front holds at most
PUBLISH_PERIOD_S = 1.0  # a front writes the ones it holds at least this often while it streams


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
        self._itl_held = HeldObservations(self.itl, PUBLISH_LATENCIES)  # see `observe_itl`
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
        """One inter-token latency, held: the front writes them in batches, at most
        `PUBLISH_LATENCIES` at a time, at the end of a request (`note_end`), and after a
        step's outputs once a second has passed since the last write (`publish_itls_due`),
        so a scrape sees them at most about a second late."""
        self._itl_held.add(seconds)

    def publish_itls_due(self) -> None:
        """The held latencies, if a second has passed since they were last written."""
        self._itl_held.publish_if_older(PUBLISH_PERIOD_S)

    def publish_itls(self) -> None:
        self._itl_held.publish()


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
        self.run_ahead_depth = Gauge(PREFIX + "run_ahead_depth", "Steps of one sequence "
                                     "planned ahead in steady decode (1: no run-ahead); paced "
                                     "by --run-ahead-budget-ms", registry=r,
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
        self._held_latencies = HeldObservations(self.step_latency, PUBLISH_STEPS)

    def observe_step(self, seconds: float, idle: bool = False) -> None:
        """A step's latency, held: written with the others of a batch (`publish_steps`),
        here once `PUBLISH_STEPS` are held or when `idle` (no other step in flight). Each
        write to the multi-process store is a locked mmap write, once per step on the
        core's loop otherwise."""
        self._held_latencies.add(seconds)
        if idle:
            self._held_latencies.publish()

    def publish_steps(self) -> None:
        """The held step latencies into `step_latency` (the core calls this when no step is
        in flight, and from its once-a-second refresh)."""
        self._held_latencies.publish()

    def refresh(self, stats: SchedulerStats, steps: int) -> None:
        """Gauges from the scheduler's snapshot; counters by what grew since the last call."""
        kv = stats.kv
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(kv.num_used_blocks / kv.num_blocks if kv.num_blocks else 0.0)
        self.in_flight.set(stats.num_outstanding_steps)
        self.run_ahead_depth.set(stats.run_ahead_depth)
        now = (kv.prefix_query_tokens, kv.prefix_hit_tokens, stats.num_preemptions, steps)
        for counter, new, old in zip((self.prefix_queries, self.prefix_hits, self.preemptions,
                                      self.steps), now, self._seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._seen = now
