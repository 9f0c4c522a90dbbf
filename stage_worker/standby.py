"""A standby stage: a stage process that holds no layers until the router assigns it the
place of a stage that failed and did not come back (``Assign``), so losing a node does not
wait for its restart.

Until then it answers ``Describe`` with ``standby`` set (and what it runs on) and refuses
``Connect``, ``Run`` and ``Drain``. ``Assign`` names the stage index, the layer range and
the capacity the pipeline was started with; the standby loads those layers (off the event
loop), becomes that stage and from then on is one: every call goes to the `StageServicer`
it built. TP size 1 only (a standby spawns no TP ranks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc

from foundation.model_config import ModelConfig
from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc
from stage_worker.config import StageConfig
from stage_worker.links import device_id, host_id
from stage_worker.service import StageServicer

log = logging.getLogger("stagemesh.stage")

NOT_ASSIGNED = ("a standby stage holds no layers until the router assigns it a failed "
                "stage's place (Assign)")


def assigned_config(cfg: StageConfig, num_layers: int, stage_index: int, num_stages: int,
                    layer_start: int, layer_end: int, num_kv_blocks: int,
                    max_num_batched_tokens: int, max_num_seqs: int) -> StageConfig:
    """The standby's config as stage `stage_index` of `num_stages` holding layers
    [layer_start, layer_end) of `num_layers`: a layer override that gives it exactly that
    range (the other stages' counts only need to add up), and the pipeline's capacity.

    Raises:
        ValueError: a range no partition into `num_stages` stages can give this stage.
    """
    before, after = stage_index, num_stages - 1 - stage_index
    if (not 0 <= stage_index < num_stages or not 0 <= layer_start < layer_end <= num_layers
            or layer_start < before or num_layers - layer_end < after
            or (before == 0) != (layer_start == 0)
            or (after == 0) != (layer_end == num_layers)):
        raise ValueError(f"stage {stage_index} of {num_stages} cannot hold layers "
                         f"{layer_start}-{layer_end - 1} of a {num_layers}-layer model")
    counts = ([1] * (before - 1) + [layer_start - (before - 1)] if before else [])
    counts += [layer_end - layer_start]
    counts += [1] * (after - 1) + [num_layers - layer_end - (after - 1)] if after else []
    return replace(cfg, stage_index=stage_index, num_stages=num_stages,
                   layer_override=tuple(counts), num_blocks=num_kv_blocks,
                   max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)


class StandbyServicer(stage_pb2_grpc.StageServiceServicer):
    """The StageService of a standby stage; `build` makes the stage an assignment asks for
    (it loads weights: it runs on a worker thread)."""

    def __init__(self, cfg: StageConfig, build: Callable[[StageConfig], StageServicer]) -> None:
        if cfg.tp_size != 1:
            raise ValueError("a standby stage runs at TP size 1 (--tp 1)")
        self.cfg = cfg
        self.num_layers = ModelConfig.from_dir(cfg.model_dir).num_layers
        self.inner: StageServicer | None = None
        self._draining = False
        self._build = build
        self._assigned: tuple[int, ...] | None = None
        self._lock = asyncio.Lock()

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        """The stage shuts down: so does the stage it became."""
        self._draining = value
        if self.inner is not None:
            self.inner.draining = value

    async def Describe(self, request: pb.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> pb.DescribeResponse:
        if self.inner is not None:
            return await self.inner.Describe(request, context)
        cfg = self.cfg
        return pb.DescribeResponse(standby=True, device=cfg.device, dtype=cfg.dtype,
                                   block_size=cfg.block_size, model_impl=cfg.model_impl,
                                   host_id=host_id(), transports=[pb.TRANSPORT_TCP],
                                   device_id=device_id(cfg.device))

    async def Assign(self, request: pb.AssignRequest,
                     context: grpc.aio.ServicerContext) -> pb.DescribeResponse:
        want = (request.stage_index, request.num_stages, request.layer_start,
                request.layer_end, request.num_kv_blocks, request.max_num_batched_tokens,
                request.max_num_seqs)
        async with self._lock:
            if self.inner is not None:
                if want != self._assigned:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"this standby already took over stage "
                                        f"{self._assigned and self._assigned[0]}")
                return await self.inner.Describe(pb.DescribeRequest(), context)
            try:
                cfg = assigned_config(self.cfg, self.num_layers, *want)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                raise AssertionError("unreachable") from e
            log.info("standby: taking over stage %d of %d (layers %d-%d); loading",
                     request.stage_index, request.num_stages, request.layer_start,
                     request.layer_end - 1)
            try:
                servicer = await asyncio.get_running_loop().run_in_executor(
                    None, self._build, cfg)
            except (ValueError, RuntimeError, OSError) as e:  # e.g. the pool does not fit
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"standby could not become stage {request.stage_index}: "
                                    f"{e}")
                raise AssertionError("unreachable") from e
            self.inner, self._assigned = servicer, want
            log.info("standby: now stage %d of %d (layers %d-%d, %d KV blocks)",
                     request.stage_index, request.num_stages, request.layer_start,
                     request.layer_end - 1, servicer.identity.num_kv_blocks)
            return await servicer.Describe(pb.DescribeRequest(), context)

    async def Connect(self, request: pb.ConnectRequest,
                      context: grpc.aio.ServicerContext) -> pb.ConnectResponse:
        if self.inner is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NOT_ASSIGNED)
        assert self.inner is not None
        return await self.inner.Connect(request, context)

    async def Run(self, request_iterator: AsyncIterator[pb.StepPlans],
                  context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResults]:
        if self.inner is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NOT_ASSIGNED)
        assert self.inner is not None
        async for results in self.inner.Run(request_iterator, context):
            yield results

    async def Drain(self, request: pb.DrainRequest,
                    context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        if self.inner is None:
            return pb.DrainResponse()
        return await self.inner.Drain(request, context)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
