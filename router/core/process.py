"""The engine core's process: `python -m router.core.process`, its `CoreConfig` as JSON on
stdin (never on the command line: it may hold the stage TLS client key).

Started by the router (`router.main`), which runs front 0 (and the front processes of
`--api-processes`). The core listens on its input socket, brings the pipeline up, tells the
fronts (`CoreState`), steps until front 0 says `Shutdown`, then drains the stages and
exits; a `Shutdown` while the stages are still awaited ends the start at once. It exits
by itself if the router dies (its parent process changes).

`run_core` is the whole life, also used in-process (the router's `--engine-core task`,
tests), where it runs as a task on the router's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from foundation.aio import unless_set
from foundation.metrics import use_multiprocess_dir
from foundation.model_config import ModelConfig
from foundation.tracing import setup_tracing
from router.core.capacity import CapacityError
from router.core.channel import CoreEndpoint
from router.core.config import CoreConfig
from router.core.engine_core import EngineCore
from router.core.messages import CoreState
from router.metrics import CoreMetrics
from router.pipeline import Pipeline, PipelineError

log = logging.getLogger("stagemesh.core")

START_ERROR_LINGER_S = 10.0  # how long a core that failed to start waits to tell its fronts


async def run_core(cfg: CoreConfig, watch_parent: bool = False) -> int:
    """The core's life: 0 after a Shutdown, 1 when it could not start (the fronts were told
    why, in a CoreState with `error`)."""
    endpoint = CoreEndpoint(cfg.input_address)
    await endpoint.start()
    credentials = cfg.stage_tls.credentials() if cfg.stage_tls else None
    pipeline = Pipeline(list(cfg.stage_addresses), credentials=credentials,
                        stage_token=cfg.stage_token, transport=cfg.transport,
                        standby=cfg.standby_stages, standby_grace_s=cfg.standby_grace_s)
    metrics = None
    if cfg.metrics_dir:
        use_multiprocess_dir(cfg.metrics_dir)
        metrics = CoreMetrics()
    core = EngineCore(cfg, ModelConfig.from_dir(Path(cfg.model_dir)), pipeline, endpoint,
                      metrics)
    receiver = asyncio.create_task(_receive(endpoint, core), name="core-receive")
    watcher = asyncio.create_task(_watch_parent()) if watch_parent else None
    try:
        try:
            if await unless_set(core.start(), core.stopped) is None:  # Shutdown came first
                log.info("shutdown before the pipeline came up")
                return 0
        except (PipelineError, CapacityError) as e:
            kind = "capacity" if isinstance(e, CapacityError) else "pipeline"
            core.start_error = CoreState(False, error=str(e), kind=kind)
            endpoint.broadcast(core.start_error)  # and to any front that says hello later
            log.error("%s", e)
            with contextlib.suppress(TimeoutError):  # until the router says Shutdown
                await asyncio.wait_for(core.stopped.wait(), START_ERROR_LINGER_S)
            return 1
        await core.serve()
        return 0
    finally:
        for task in (receiver, watcher):
            if task is not None:
                task.cancel()
        await pipeline.close(drain=True)
        await asyncio.sleep(0.05)  # let queued messages leave before the sockets close
        endpoint.close()


async def _receive(endpoint: CoreEndpoint, core: EngineCore) -> None:
    while True:
        core.handle(await endpoint.receive())


async def _watch_parent() -> None:
    """Exit when the router that started this process is gone."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            log.error("the router (pid %d) is gone; exiting", parent)
            os._exit(1)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[core] %(message)s", stream=sys.stderr)
    # The router decides when the core stops (Shutdown, after its drain); a Ctrl-C or a
    # SIGTERM sent to the whole process group must not cut the in-flight requests short.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    cfg = CoreConfig.from_json(sys.stdin.read())
    setup_tracing("stagemesh-router", cfg.otlp_traces_endpoint)
    return asyncio.run(run_core(cfg, watch_parent=True))


if __name__ == "__main__":
    sys.exit(main())
