"""A whole mesh in the test's process and event loop: P real StageService servicers (each a
grpc.aio server on 127.0.0.1, linked by the real TCP data plane) and the real router app in
front of them: its front and InferenceServicer, and its engine core (scheduler, pipeline
driver) as a task on the same loop (`engine_core="task"`; pass "process" for the real
child process), talking over the real channel (a Unix-domain stream per front); with
`api_processes=N` the router also starts N - 1 real front processes on the same port. A
test runs in well under a second with the null model and in seconds with the default model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from router.client import RouterClient
from router.config import RouterConfig
from router.main import RouterApp
from stage_worker.config import StageConfig
from tests.stage_worker.serving import Stage, stage_configs, start_stage

__all__ = ["InProcessMesh", "in_process_mesh", "stage_configs", "start_stage"]


@dataclass
class InProcessMesh:
    app: RouterApp
    address: str
    stages: list[Stage]

    def client(self, own_connection: bool = False) -> RouterClient:
        """A client; `own_connection` gives it a TCP connection of its own, which the kernel
        hands to one of the router's front processes (`api_processes`)."""
        return RouterClient(self.address, own_connection=own_connection)

    def stage_sequences(self) -> list[int]:
        """Sequences each stage holds now."""
        return [len(s.servicer.leader.rank.held.seqs) for s in self.stages]


@asynccontextmanager
async def in_process_mesh(stages: list[StageConfig], **router: Any
                          ) -> AsyncIterator[InProcessMesh]:
    """The stages, then a router over them (RouterConfig fields in `router`); everything is
    stopped on exit, the router first (it drains).

    The stages share this process's cores, so the router's default would keep one
    micro-batch between them; unless a test gives `micro_batches`, it gets one per stage, as
    stages on their own devices run (the path with several steps in flight is the one to
    cover)."""
    async with AsyncExitStack() as stack:
        started = []
        for cfg in stages:
            stage = await start_stage(cfg)
            stack.push_async_callback(stage.stop)
            started.append(stage)
        model_dir = stages[0].model_dir
        cfg = RouterConfig(model_dir=model_dir, model_name=model_dir.name,
                           stage_addresses=tuple(s.address for s in started), port=0,
                           **{"drain_timeout_s": 2.0, "startup_budget_s": 20.0,
                              "engine_core": "task", "micro_batches": len(stages), **router})
        app = RouterApp(cfg)
        address = await app.start()
        stack.push_async_callback(app.drain_and_stop)
        yield InProcessMesh(app, address, started)
