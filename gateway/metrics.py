"""Prometheus text exposition (format 0.0.4) of the gateway's own figures and the router's.

Gateway: requests by route and status, request duration and time to first token as
histograms, requests in flight, tokens, client disconnects. Router (read from GetStats at
scrape time): queue, KV blocks on the router's books and per stage as
`stagemesh_kv_blocks_used{stage="i"}`, the transport of each hop between stages as
`stagemesh_stage_hop_transport{stage="i",transport="tcp"} 1`, steps and finished requests;
`stagemesh_router_up` is 0 when the router did not answer.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from protos.stagemesh.v1 import inference_pb2 as pb

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a cached health check to a long CPU generation.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass
class Histogram:
    """Cumulative buckets (upper bounds `bounds`, then +Inf), sum and count."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def lines(self, name: str, labels: Labels) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            le = 'le="' + ("+Inf" if bound == float("inf") else _num(bound)) + '"'
            out.append(f"{name}_bucket{_labels(labels, le)} {running}")
        out.append(f"{name}_sum{_labels(labels)} {_num(self.total)}")
        out.append(f"{name}_count{_labels(labels)} {running}")
        return out


class Family:
    """One metric name: its help, type and samples by label set."""

    def __init__(self, name: str, kind: str, help_text: str) -> None:
        self.name, self.kind, self.help = name, kind, help_text
        self.values: dict[Labels, float] = defaultdict(float)
        self.histograms: dict[Labels, Histogram] = {}

    def inc(self, labels: Labels = (), by: float = 1.0) -> None:
        self.values[labels] += by

    def set(self, value: float, labels: Labels = ()) -> None:
        self.values[labels] = value

    def observe(self, value: float, labels: Labels = ()) -> None:
        self.histograms.setdefault(labels, Histogram()).observe(value)

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for labels, value in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(labels)} {_num(value)}")
        for labels, hist in sorted(self.histograms.items()):
            out += hist.lines(self.name, labels)
        return out


class GatewayMetrics:
    """The gateway's counters; `render` adds the router's figures from one GetStats reply."""

    def __init__(self) -> None:
        g = "stagemesh_gateway_"
        self.requests = Family(g + "requests_total", "counter",
                               "HTTP requests answered, by route, method and status")
        self.duration = Family(g + "request_duration_seconds", "histogram",
                               "Time from request to the last byte of the response")
        self.ttft = Family(g + "time_to_first_token_seconds", "histogram",
                           "Time from request to the first streamed update from the router")
        self.in_flight = Family(g + "requests_in_flight", "gauge", "Requests being answered")
        self.tokens = Family(g + "tokens_total", "counter",
                             "Prompt and completion tokens of finished requests, by kind")
        self.disconnects = Family(g + "client_disconnects_total", "counter",
                                  "Requests whose client went away first (router call "
                                  "cancelled)")
        self.in_flight.set(0)
        self.disconnects.set(0)

    def render(self, stats: pb.GetStatsResponse | None) -> str:
        families = [self.requests, self.duration, self.ttft, self.in_flight, self.tokens,
                    self.disconnects, *router_families(stats)]
        return "\n".join(line for f in families for line in f.lines()) + "\n"


_ROUTER_GAUGES = (
    ("num_waiting", "stagemesh_router_requests_waiting", "gauge", "Requests waiting"),
    ("num_running", "stagemesh_router_requests_running", "gauge", "Requests running"),
    ("kv_blocks_used", "stagemesh_router_kv_blocks_used", "gauge",
     "KV blocks held by running sequences, on the router's books"),
    ("kv_blocks_total", "stagemesh_router_kv_blocks_total", "gauge",
     "KV blocks the router allocates from"),
    ("kv_blocks_cached", "stagemesh_router_kv_blocks_cached", "gauge",
     "Free blocks holding reusable prefix-cache entries"),
    ("prefix_cache_hit_rate", "stagemesh_router_prefix_cache_hit_rate", "gauge",
     "Fraction of prompt tokens served from the prefix cache since start"),
    ("steps", "stagemesh_router_steps_total", "counter", "Pipeline steps since start"),
    ("requests_finished", "stagemesh_router_requests_finished_total", "counter",
     "Requests finished since start"),
)
_STAGE_GAUGES = (
    ("kv_blocks_used", "stagemesh_kv_blocks_used", "KV blocks in use on the stage"),
    ("kv_blocks_total", "stagemesh_kv_blocks_total", "KV blocks in the stage's pool"),
    ("num_sequences", "stagemesh_stage_sequences", "Sequences with state on the stage"),
    ("ready", "stagemesh_stage_ready", "1 when the stage is linked and serving"),
)


def router_families(stats: pb.GetStatsResponse | None) -> list[Family]:
    up = Family("stagemesh_router_up", "gauge", "1 when the router answered GetStats")
    up.set(0 if stats is None else 1)
    if stats is None:
        return [up]
    out = [up]
    for attr, name, kind, help_text in _ROUTER_GAUGES:
        fam = Family(name, kind, help_text)
        fam.set(float(getattr(stats, attr)))
        out.append(fam)
    for attr, name, help_text in _STAGE_GAUGES:
        fam = Family(name, "gauge", help_text)
        for s in stats.stages:
            fam.set(float(getattr(s, attr)), (("stage", str(s.stage)),))
        out.append(fam)
    hops = Family("stagemesh_stage_hop_transport", "gauge",
                  "1 for the data-plane transport of the hop from the stage to the next")
    for s in stats.stages:
        if s.transport:  # the last stage has no hop
            hops.set(1, (("stage", str(s.stage)), ("transport", s.transport)))
    out.append(hops)
    return out
