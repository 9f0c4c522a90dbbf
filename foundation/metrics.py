"""What every service's Prometheus metrics share: the `/metrics` HTTP server, histogram
buckets that match vLLM's (so its dashboards read ours), and the multi-process store of a
service that runs in several processes (the router: its fronts and engine core).

Metrics are prometheus_client objects, each service's in its own module
(`router.metrics`, `stage_worker.metrics`, `gateway.metrics`); docs/OBSERVABILITY.md lists
them all.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server, values

PREFIX = "stagemesh_"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# vLLM's buckets (seconds) for the same metrics.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Ours: a step, a stage's share of one, a hop (seconds, from 50 us to 10 s).
STEP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for every v of `values`, with one write per bucket touched and
    one to the sum. In the multi-process store every write is a locked mmap write; fronts,
    the engine core and stages write their held latencies and per-step figures this way
    (`HeldObservations`). The bucket counts come out as observing them one by one;
    the sum to rounding (added once). Reads prometheus_client's `_sum`, `_buckets` and
    `_upper_bounds` (a test holds this to `observe`)."""
    if not values:
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(sum(values))
    bounds, buckets = histogram._upper_bounds, histogram._buckets
    for i, n in Tally(bisect_left(bounds, v) for v in values).items():  # v <= bounds[i]
        buckets[i].inc(n)


class HeldObservations:
    """Values for one histogram, held in a list and written in batches (`observe_many`):
    once `limit` are held, or when the owner calls `publish` (or `publish_if_older`). For
    one thread: the loop of the process that records them."""

    def __init__(self, histogram: Histogram, limit: int) -> None:
        self.histogram = histogram
        self.limit = limit
        self._values: list[float] = []
        self._published = time.monotonic()

    def add(self, value: float) -> None:
        values = self._values
        values.append(value)
        if len(values) >= self.limit:
            self.publish()

    def publish(self) -> None:
        values, self._values = self._values, []
        self._published = time.monotonic()
        observe_many(self.histogram, values)

    def publish_if_older(self, seconds: float) -> None:
        """`publish`, if values are held and the last write was `seconds` ago or more."""
        if self._values and time.monotonic() - self._published >= seconds:
            self.publish()


@dataclass
class MetricsServer:
    """A running `/metrics` endpoint (prometheus_client's HTTP server in a daemon thread)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0"
                  ) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics (port 0: any free port, see `.port`).
    Raises OSError when the port cannot be bound."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)


def use_multiprocess_dir(directory: str) -> None:
    """Make this process (and the children it starts after this) record metrics in
    `directory`, where `prometheus_client.multiprocess.MultiProcessCollector` sums them.

    prometheus_client picks its value store when it is first imported; this also switches
    the store of metrics created from now on, so the order of imports does not matter.
    """
    os.environ[MULTIPROC_ENV] = directory
    values.ValueClass = values.get_value_class()


def remove_multiprocess_dir(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    if os.environ.get(MULTIPROC_ENV) == directory:
        del os.environ[MULTIPROC_ENV]
        values.ValueClass = values.get_value_class()


def multiprocess_registry(directory: str) -> CollectorRegistry:
    """A registry that reads every process's metrics from `directory` at each scrape."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    return registry
