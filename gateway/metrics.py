"""The gateway's Prometheus metrics (prometheus_client), and the router's figures as the
gateway sees them through GetStats at scrape time.

Gateway: requests by route, method and status; request duration and time to first token
as histograms; requests in flight; tokens; client disconnects. Router view (one GetStats
per scrape, for deployments that scrape the gateway alone; the router and every stage also
serve their own, fuller `/metrics`): queue, KV blocks on the router's books and per stage as
`stagemesh_kv_blocks_used{stage="i"}`, the transport of each hop between stages as
`stagemesh_stage_hop_transport{stage="i",transport="tcp"} 1`, steps and finished requests;
`stagemesh_router_up` is 0 when the router did not answer. docs/OBSERVABILITY.md lists them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from foundation.metrics import PREFIX
from protos.stagemesh.v1 import inference_pb2 as pb

# The text format `generate_latest` writes for names like ours (every Prometheus reads it).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a cached health check to a long CPU generation.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)


class GatewayMetrics:
    """The gateway's own metrics, in its own registry; `render` adds the router's view."""

    def __init__(self) -> None:
        g = PREFIX + "gateway_"
        self.registry = r = CollectorRegistry()
        self.requests = Counter(g + "requests", "HTTP requests answered, by route, method and "
                                "status", ["route", "method", "status"], registry=r)
        self.duration = Histogram(g + "request_duration_seconds", "Time from request to the "
                                  "last byte of the response", ["route"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(g + "time_to_first_token_seconds", "Time from request to the "
                              "first streamed update from the router", ["route"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge(g + "requests_in_flight", "Requests being answered", registry=r)
        self.tokens = Counter(g + "tokens", "Prompt and completion tokens of finished "
                              "requests, by kind", ["kind"], registry=r)
        self.disconnects = Counter(g + "client_disconnects", "Requests whose client went away "
                                   "first (router call cancelled)", registry=r)

    def render(self, stats: pb.GetStatsResponse | None) -> bytes:
        """The exposition text: the gateway's metrics, then the router's view of `stats`
        (None: the router did not answer)."""
        view = CollectorRegistry()
        view.register(RouterView(stats))
        return generate_latest(self.registry) + generate_latest(view)


_ROUTER_GAUGES = (
    ("num_waiting", "router_requests_waiting", "Requests waiting"),
    ("num_running", "router_requests_running", "Requests running"),
    ("kv_blocks_used", "router_kv_blocks_used",
     "KV blocks held by running sequences, on the router's books"),
    ("kv_blocks_total", "router_kv_blocks_total", "KV blocks the router allocates from"),
    ("kv_blocks_cached", "router_kv_blocks_cached",
     "Free blocks holding reusable prefix-cache entries"),
    ("prefix_cache_hit_rate", "router_prefix_cache_hit_rate",
     "Fraction of prompt tokens served from the prefix cache since start"),
)
_ROUTER_COUNTERS = (
    ("steps", "router_steps", "Pipeline steps since start"),
    ("requests_finished", "router_requests_finished", "Requests finished since start"),
)
_STAGE_GAUGES = (
    ("kv_blocks_used", "kv_blocks_used", "KV blocks in use on the stage"),
    ("kv_blocks_total", "kv_blocks_total", "KV blocks in the stage's pool"),
    ("num_sequences", "stage_sequences", "Sequences with state on the stage"),
    ("ready", "stage_ready", "1 when the stage is linked and serving"),
)


class RouterView(Collector):
    """The router's figures from one GetStats reply (None: `stagemesh_router_up` 0 alone)."""

    def __init__(self, stats: pb.GetStatsResponse | None) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        yield GaugeMetricFamily(PREFIX + "router_up", "1 when the router answered GetStats",
                                value=0 if stats is None else 1)
        if stats is None:
            return
        for attr, name, help_text in _ROUTER_GAUGES:
            yield GaugeMetricFamily(PREFIX + name, help_text, value=float(getattr(stats, attr)))
        for attr, name, help_text in _ROUTER_COUNTERS:
            yield CounterMetricFamily(PREFIX + name, help_text,
                                      value=float(getattr(stats, attr)))
        for attr, name, help_text in _STAGE_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=["stage"])
            for s in stats.stages:
                family.add_metric([str(s.stage)], float(getattr(s, attr)))
            yield family
        hops = GaugeMetricFamily(PREFIX + "stage_hop_transport", "1 for the data-plane "
                                 "transport of the hop from the stage to the next",
                                 labels=["stage", "transport"])
        for s in stats.stages:
            if s.transport:  # the last stage has no hop
                hops.add_metric([str(s.stage), s.transport], 1)
        yield hops
