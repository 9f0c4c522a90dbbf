"""Stage servicers in the test's process and event loop: each a real grpc.aio server on
127.0.0.1 over a real stage (the null model or a checkpoint), linked by the real TCP data
plane when a router's pipeline driver connects them. Imports nothing of the router's app,
so the driver's tests run without it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from protos.stagemesh.stage.v1 import stage_pb2_grpc
from stage_worker.config import StageConfig
from stage_worker.main import stage_servicer
from stage_worker.parallel import TPGroup
from stage_worker.service import StageServicer


@dataclass
class Stage:
    """One in-process stage: its servicer (state readable by tests) and its server."""

    servicer: StageServicer
    server: grpc.aio.Server
    address: str

    async def stop(self) -> None:
        await self.server.stop(grace=None)
        self.servicer.close()


async def start_stage(cfg: StageConfig) -> Stage:
    """Serve `cfg`'s stage on `cfg.host:cfg.port` (port 0 picks one)."""
    servicer = stage_servicer(cfg, TPGroup())
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    return Stage(servicer, server, f"{cfg.host}:{port}")


def stage_configs(model_dir: Path, num_stages: int, **fields: Any) -> list[StageConfig]:
    """`num_stages` configs of one pipeline; `fields` apply to every stage."""
    base = StageConfig(model_dir=model_dir, num_stages=num_stages, **fields)
    return [replace(base, stage_index=i) for i in range(num_stages)]
