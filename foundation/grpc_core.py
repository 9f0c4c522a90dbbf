"""gRPC core settings for the mesh's processes, applied before gRPC starts in them.

gRPC core reads its `GRPC_EXPERIMENTS` environment variable once, when it starts. In
current releases its I/O runs on the EventEngine (the experiments below, on by default). For
the mesh's traffic, a steady stream of small messages on a few long-lived streams, the
older I/O manager (iomgr, still gRPC's own supported path) costs less CPU per message. On
the 2-core VM (2026-12-05, grpcio 1.85.3, `benchmarks.grpc_stream_floor`), the `Run`
stream's plan-and-answer round trip costs 156-190 µs of CPU a side with these experiments
off and 188-261 with them on, and a client's streamed `Generate` response 27-35 µs against
43-44 (W6 and the rest: docs/BENCHMARKS.md, "gRPC core's older I/O manager").

`apply_defaults` sets the variable unless the environment already has it (an operator's
value, even an empty one, wins: `GRPC_EXPERIMENTS=` gives gRPC's own defaults back). The
`stagemesh` command calls it first thing, before any module imports grpc, and every process
it starts (router, engine core, fronts, stages and their TP ranks, gateway) inherits it. A
process that imported grpc already keeps what it started with.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
# The EventEngine experiments of grpcio 1.85 that move a process's I/O off iomgr: client
# channels, servers' listeners, the completion queue of callbacks, and every other endpoint.
# An unknown name is only logged by gRPC (one line at start), never fatal.
LEGACY_IO = ",".join(f"-{name}" for name in (
    "event_engine_client", "event_engine_listener", "event_engine_callback_cq",
    "event_engine_for_all_other_endpoints"))


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set `GRPC_EXPERIMENTS` to `LEGACY_IO` unless `environ` has it: call before grpc is
    imported in this process (children inherit it)."""
    environ.setdefault(EXPERIMENTS_ENV, LEGACY_IO)
