"""The router process: public gRPC API, health, reflection; drives the stages."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from foundation.api_keys import ApiKeys
from foundation.model_config import ModelConfig
from foundation.tls import ListenError, add_port
from foundation.tokenizer import ModelTokenizer
from protos.stagemesh.v1 import inference_pb2, inference_pb2_grpc
from router.auth import ApiKeyInterceptor
from router.capacity import Capacity, CapacityError, plan_capacity
from router.config import RouterConfig
from router.engine import Engine, EngineConfig
from router.pipeline import Pipeline, PipelineError, PipelineShape
from router.scheduler import Scheduler
from router.service import InferenceServicer, ServedModel

log = logging.getLogger("stagemesh.router")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RouterApp:
    """Composes tokenizer, pipeline, engine and servicers; owns the server's lifetime.

    The gRPC server (health NOT_SERVING) starts first; the scheduler and the served model's
    limits are built once the stages have reported their capacity (`plan_capacity`).
    """

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.tokenizer = ModelTokenizer.from_dir(cfg.model_dir)
        self.model = ModelConfig.from_dir(cfg.model_dir)
        stage_credentials = cfg.stage_tls.credentials() if cfg.stage_tls else None
        pipeline = Pipeline(list(cfg.stage_addresses), credentials=stage_credentials)
        self.engine = Engine(EngineConfig(cfg.step_timeout_s, cfg.recovery_budget_s,
                                          cfg.stream_interval),
                             self._make_scheduler, pipeline, self.tokenizer)
        self._capacity: Capacity | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.served: asyncio.Future[ServedModel] = asyncio.get_running_loop().create_future()
        self.servicer = InferenceServicer(self.engine, self.tokenizer, self.served)
        self.health = health.HealthServicer()
        interceptors = [ApiKeyInterceptor(ApiKeys(cfg.api_keys))] if cfg.api_keys else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", cfg.max_request_bytes),
            ("grpc.max_send_message_length", 64 << 20)])

    def _make_scheduler(self, shape: PipelineShape) -> Scheduler:
        """Raises CapacityError when a flag exceeds what the stages reported."""
        self._capacity = plan_capacity(self.cfg, self.model, shape)
        return Scheduler(self._capacity.scheduler, self._capacity.kv)

    async def start(self) -> str:
        """Serve health at once, then wait for the stages. Returns the bound address.

        Raises ListenError (the port), PipelineError (the stages did not come up within the
        startup budget) or CapacityError (a flag exceeds a stage's capacity), with everything
        it started stopped again.
        """
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._set_health(live=True, ready=False)
        names = (inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
                 health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        port = add_port(self.server, self.cfg.host, self.cfg.port, self.cfg.tls)
        await self.server.start()
        address = f"{self.cfg.host}:{port}"
        log.info("router listening on %s; waiting for %d stage(s)", address,
                 len(self.cfg.stage_addresses))
        try:
            shape = await self.engine.start(self.cfg.startup_budget_s)
        except BaseException:
            await self.server.stop(grace=None)
            await self.engine.pipeline.close(drain=False)
            raise
        assert self._capacity is not None
        self.served.set_result(ServedModel(
            self.cfg.model_name, self._capacity.limits, shape.dtype, shape.tp_size,
            shape.num_stages, shape.block_size))
        self._watcher = asyncio.create_task(self._watch_readiness())
        return address

    def _set_health(self, live: bool, ready: bool) -> None:
        self.health.set("liveness", SERVING if live else NOT_SERVING)
        self.health.set("readiness", SERVING if ready else NOT_SERVING)
        self.health.set("", SERVING if ready else NOT_SERVING)

    async def _watch_readiness(self) -> None:
        last = None
        while True:
            ready = self.engine.ready and not self.servicer.draining
            if ready != last:
                self._set_health(live=True, ready=ready)
                log.info("readiness: %s", "SERVING" if ready else "NOT_SERVING")
                last = ready
            await asyncio.sleep(0.1)

    async def drain_and_stop(self) -> None:
        """SIGTERM: NOT_SERVING at once, refuse new work, let in-flight requests finish."""
        self.servicer.draining = True
        self._set_health(live=True, ready=False)
        deadline = asyncio.get_running_loop().time() + self.cfg.drain_timeout_s
        while self.engine.requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self.engine.stop()
        await self.server.stop(grace=1.0)
        await self.engine.pipeline.close(drain=True)
        if self._watcher is not None:
            self._watcher.cancel()


async def serve_router(cfg: RouterConfig, ready_file: str | None = None) -> int:
    app = RouterApp(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    address = await app.start()
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            f.write(address)
        os.replace(ready_file + ".tmp", ready_file)
    await stop.wait()
    log.info("draining")
    await app.drain_and_stop()
    return 0


def run_router(cfg: RouterConfig, ready_file: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[router] %(message)s", stream=sys.stderr)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        return asyncio.run(serve_router(cfg, ready_file))
    except PipelineError as e:
        log.error("%s. Check that every stage in --stages is running and reachable, in "
                  "pipeline order, with matching TLS settings; --startup-budget sets the wait.",
                  e)
        return 1
    except CapacityError as e:
        log.error("%s", e)
        return 1
    except ListenError as e:
        log.error("%s", e)
        return 1
