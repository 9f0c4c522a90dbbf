"""The StageService: a thin gRPC skin over the stage leader. Protos stop here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc
from stage_worker.config import StageConfig
from stage_worker.convert import error_to_proto, outcome_to_proto, plan_from_proto
from stage_worker.dataplane import TransportError, TransportKind
from stage_worker.leader import StageLeader
from stage_worker.links import device_id, host_id
from stage_worker.plan import PlanError, StageOutcome, StagePlan
from stage_worker.run_state import (
    QueuedStep,
    QuietProgress,
    RunState,
    Settler,
    SkippedStep,
    discard,
    ignore_result,
)
from stage_worker.stage_rank import StageRank
from stage_worker.step_thread import StepThread

log = logging.getLogger("stagemesh.stage")

# Plans converted and queued on the worker ahead of the step running (the router keeps at
# most 2P steps outstanding; this only bounds a client that does not).
MAX_QUEUED_STEPS = 16

_KIND_ENUMS = {TransportKind.TCP: pb.TRANSPORT_TCP, TransportKind.CUDA_IPC: pb.TRANSPORT_CUDA_IPC,
               TransportKind.NCCL: pb.TRANSPORT_NCCL, TransportKind.UNIX: pb.TRANSPORT_UNIX}
_ENUM_KINDS = {pb.TRANSPORT_UNSPECIFIED: TransportKind.TCP,
               **{enum: kind for kind, enum in _KIND_ENUMS.items()}}
_ACTIVATION_ROLES = frozenset({pb.LINK_ROLE_LISTEN_UPSTREAM, pb.LINK_ROLE_CONNECT_DOWNSTREAM})


@dataclass(frozen=True)
class StageIdentity:
    """What Describe reports besides live usage: what the stage holds and sized itself for."""

    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int
    device: str
    dtype: str
    tp_size: int
    num_kv_blocks: int
    block_size: int
    hidden_size: int
    vocab_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    model_impl: str

    @classmethod
    def of(cls, cfg: StageConfig, rank: StageRank) -> StageIdentity:
        """The identity of the stage whose TP rank 0 is `rank`, built from `cfg`."""
        shape, limits = rank.shape, rank.limits
        return cls(cfg.stage_index, cfg.num_stages, shape.layers.start, shape.layers.end,
                   str(shape.device), str(shape.dtype).removeprefix("torch."), cfg.tp_size,
                   limits.num_blocks, limits.block_size, shape.hidden_size, shape.vocab_size,
                   limits.max_num_batched_tokens, limits.max_num_seqs, rank.runner.impl)


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    """Runs steps one at a time on a single worker thread (it owns every torch call)."""

    def __init__(self, leader: StageLeader, identity: StageIdentity) -> None:
        self.leader = leader
        self.identity = identity
        self.draining = False
        self._worker = StepThread("stage-step")
        self._run_generation = 0
        self._run: RunState | None = None
        # Plans handed to the worker, and plans it started: each written by one thread
        # only, so their difference (the backlog) needs no lock.
        self._submitted = 0
        self._started = 0

    def _call(self, fn: object, *args: object) -> asyncio.Future[object]:
        """`fn(*args)` queued on the step thread now; its result as a future of this loop
        (cancelling it before it runs skips it)."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._worker, fn, *args)  # type: ignore[arg-type]

    async def Describe(self, request: pb.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> pb.DescribeResponse:
        i, held = self.identity, self.leader.rank.held
        step_s, bubble = self.leader.window.snapshot()
        return pb.DescribeResponse(
            stage_index=i.stage_index, num_stages=i.num_stages, layer_start=i.layer_start,
            layer_end=i.layer_end, device=i.device, dtype=i.dtype, tp_size=i.tp_size,
            num_kv_blocks=i.num_kv_blocks, block_size=i.block_size, hidden_size=i.hidden_size,
            vocab_size=i.vocab_size, kv_blocks_used=held.kv_blocks_used,
            num_sequences=len(held.seqs),
            transports=[_KIND_ENUMS[k] for k in self.leader.transports], host_id=host_id(),
            max_num_batched_tokens=i.max_num_batched_tokens, max_num_seqs=i.max_num_seqs,
            model_impl=i.model_impl, steps=self.leader.window.total,
            step_time_ms=step_s * 1e3, bubble_fraction=bubble, device_id=device_id(i.device),
        )

    async def Connect(self, request: pb.ConnectRequest,
                      context: grpc.aio.ServicerContext) -> pb.ConnectResponse:
        kind = _ENUM_KINDS.get(request.transport)
        if kind is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"transport {pb.Transport.Name(request.transport)} is not "
                                "implemented (have: TRANSPORT_TCP, TRANSPORT_UNIX, "
                                "TRANSPORT_CUDA_IPC, TRANSPORT_NCCL)")
        if kind not in self.leader.transports and request.role in _ACTIVATION_ROLES:
            offered = ", ".join(pb.Transport.Name(_KIND_ENUMS[k]) for k in self.leader.transports)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"transport {pb.Transport.Name(request.transport)} is not "
                                f"offered by this stage (it offers {offered})")
        if request.role not in _ACTIVATION_ROLES and kind is not TransportKind.TCP:
            if kind is not TransportKind.UNIX:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "the feedback link is TRANSPORT_TCP or TRANSPORT_UNIX")
            if kind not in self.leader.transports:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "this stage does not offer TRANSPORT_UNIX")
        listen = {pb.LINK_ROLE_LISTEN_UPSTREAM: self.leader.listen_upstream,
                  pb.LINK_ROLE_LISTEN_FEEDBACK: self.leader.listen_feedback}.get(request.role)
        connect = {pb.LINK_ROLE_CONNECT_DOWNSTREAM: self.leader.connect_downstream,
                   pb.LINK_ROLE_CONNECT_FEEDBACK: self.leader.connect_feedback}.get(request.role)
        args = (request.address, request.link_token, request.epoch, kind)
        try:
            if listen is not None:
                address = await self._call(listen, *args)
                return pb.ConnectResponse(address=str(address))
            if connect is not None:
                await self._call(connect, *args)
                return pb.ConnectResponse()
        except (ValueError, OSError, TransportError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"data-plane link failed: {e}")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"unknown link role {request.role}")
        raise AssertionError("unreachable")

    async def Run(self, request_iterator: AsyncIterator[pb.StepPlans],
                  context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResults]:
        """Plans in, results out, strictly in order. A newer Run supersedes an older one.

        A reader task converts each plan as it arrives and queues its step on the worker
        thread at once, so the worker starts step k+1 while step k's result is serialised
        and sent (the router sends plans ahead of results); a one-stage pipeline also
        queues step k+1 on the GPU before waiting for step k (`StageLeader.step_overlapped`).
        Only the last stage answers every step (its sampled tokens), the answers that are
        ready together in one message, and an answer whose plan says `hold_answer` in one
        message with the next step's when that step is already queued; the others answer
        only a step that failed, and their steps wake this loop only then
        (`QuietProgress`). After a failed step, the steps queued behind it are skipped and
        the stream ends with that step's error.
        """
        self._run_generation += 1
        if self._run is not None:  # superseded: its handler stops waiting
            self._run.skip_unanswered()
        loop = asyncio.get_running_loop()
        answers = self.leader.rank.is_last  # others answer only a failed step
        run = self._run = RunState(self._run_generation, Settler(loop),
                                    quiet=None if answers else QuietProgress(loop))
        epoch = self.leader.links.epoch  # the links this run's steps use
        await self._call(self.leader.reset)
        if run.quiet is not None:
            async for quiet_answer in self._run_quiet(request_iterator, run, run.quiet, epoch):
                yield quiet_answer
            return
        queued: asyncio.Queue[QueuedStep | None] = asyncio.Queue()
        room = asyncio.Semaphore(MAX_QUEUED_STEPS)
        reader = asyncio.create_task(self._queue_steps(request_iterator, run, queued, room))
        ahead: QueuedStep | None = None  # taken, not awaited
        try:
            while True:
                item, ahead = ahead or await queued.get(), None
                if item is None:
                    return
                results: list[pb.StepResult] = []
                ended = False
                while True:  # this step, then every queued one done or held for
                    step_id, future, hold = item
                    try:
                        outcome = await future
                    except SkippedStep:
                        ended = True
                        break
                    except Exception as e:
                        results.append(self._failed(step_id, e))
                        ended = True
                        break
                    room.release()
                    if answers:
                        results.append(outcome_to_proto(outcome))
                    if queued.empty():
                        break
                    ahead = queued.get_nowait()
                    if ahead is None or not (hold or ahead.future.done()):
                        ended = ahead is None
                        break
                    item, ahead = ahead, None
                if results:
                    yield pb.StepResults(results=results)
                if ended:
                    return
        finally:
            if ahead is not None:
                ahead.future.add_done_callback(ignore_result)
            discard(queued)
            await self._end_run(run, reader, epoch)

    async def _run_quiet(self, requests: AsyncIterator[pb.StepPlans], run: RunState,
                         progress: QuietProgress, epoch: int) -> AsyncIterator[pb.StepResults]:
        """`Run` for a stage that answers only a failed step: queue every plan on the
        worker, then wait for the stream to end (its steps finished) or a step to fail."""
        reader = asyncio.create_task(self._queue_quiet_steps(requests, run, progress))
        try:
            await asyncio.wait((reader, progress.failure), return_when=asyncio.FIRST_COMPLETED)
            if not progress.failed:  # the stream ended: its steps finish first
                await progress.wait_until_backlog(0)
            if progress.first_failure is not None:
                step_id, error = progress.first_failure
                if isinstance(error, Exception) and not isinstance(error, SkippedStep):
                    yield pb.StepResults(results=[self._failed(step_id, error)])
        finally:
            await self._end_run(run, reader, epoch)

    async def _end_run(self, run: RunState, reader: asyncio.Task[None], epoch: int) -> None:
        """A Run stream's end, however it ended: its reader stopped, its later steps
        skipped and, unless a newer Run took over, the worker freed from waiting on the
        links of `epoch` and the stage's sequences dropped."""
        run.stopped = True
        reader.cancel()
        if run.generation == self._run_generation:  # the router went: free the worker
            self.leader.interrupt(epoch, "the Run stream ended")
        run.skip_unanswered()
        if run.generation == self._run_generation:
            # Shielded: a handler cancelled while it waits (the process stopping right
            # after the router went) leaves the reset queued, and the reset logs itself.
            await asyncio.shield(self._call(self._reset_run))

    def _reset_run(self) -> None:
        """On the step thread: drop every sequence (a Run stream ended), saying how many."""
        log.info("run stream closed; dropped %s sequence(s)", self.leader.reset())

    async def _queue_quiet_steps(self, requests: AsyncIterator[pb.StepPlans], run: RunState,
                                 progress: QuietProgress) -> None:
        """`_queue_steps` for `_run_quiet`: the backlog bounded by waiting on `progress`; a
        plan that does not convert fails its step once the steps before it finished."""
        step_id = -1
        try:
            async for plans in requests:
                for msg in plans.plans:
                    await progress.wait_until_backlog(MAX_QUEUED_STEPS - 1)
                    if self._superseded(run) or progress.failed:
                        return
                    step_id = msg.step_id
                    plan = plan_from_proto(msg)
                    progress.submitted += 1
                    self._submitted += 1
                    self._worker.run_later(self._run_step, run, plan)
        except grpc.RpcError as e:  # the client went away: the stream ends
            log.info("run stream: %s", e)
        except Exception as e:  # a plan that does not convert: that step's error
            await progress.wait_until_backlog(0)
            progress.fail(step_id, e)

    async def _queue_steps(self, requests: AsyncIterator[pb.StepPlans], run: RunState,
                           queued: asyncio.Queue[QueuedStep | None],
                           room: asyncio.Semaphore) -> None:
        """Each plan of `requests` onto the worker, in order; None queued at the end."""
        loop = asyncio.get_running_loop()
        step_id = -1
        try:
            async for plans in requests:
                for msg in plans.plans:
                    if self._superseded(run):
                        return
                    await room.acquire()
                    step_id = msg.step_id
                    plan = plan_from_proto(msg)
                    future: asyncio.Future[StageOutcome] = loop.create_future()
                    run.outcomes[step_id] = future
                    self._submitted += 1
                    if msg.hold_answer:
                        run.held.add(step_id)
                    self._worker.run_later(self._run_step, run, plan)
                    queued.put_nowait(QueuedStep(step_id, future, msg.hold_answer))
        except grpc.RpcError as e:  # the client went away: the stream ends
            log.info("run stream: %s", e)
        except Exception as e:  # a plan that does not convert: that step's error
            failed: asyncio.Future[StageOutcome] = loop.create_future()
            failed.set_exception(e)
            queued.put_nowait(QueuedStep(step_id, failed, False))
        finally:
            queued.put_nowait(None)

    def _run_step(self, run: RunState, plan: StagePlan) -> None:
        """Worker thread: `plan`'s step, unless its run stopped, failed or was superseded;
        each outcome (this step's, or an earlier one left pending) settles its future. The
        outcome of a step whose answer is held (`hold_answer`) does not wake the loop when a
        later step is on the worker already: that step's outcome, or its failure or skip,
        wakes it and settles both (the loop's answer waits for the later one anyway)."""
        self._started += 1
        started = self._started
        quiet = run.quiet

        def deliver(outcome: StageOutcome) -> None:
            step_id = outcome.step_id
            future = run.outcomes.pop(step_id, None)
            if future is not None:
                later = step_id != plan.step_id or self._submitted > started
                held = step_id in run.held
                run.held.discard(step_id)
                run.settler.put(future, outcome, None, wake=not (held and later))

        def fail(error: BaseException) -> None:
            if quiet is not None:
                if not isinstance(error, SkippedStep):
                    quiet.fail_from_worker(plan.step_id, error)
                return
            future = run.outcomes.pop(plan.step_id, None)
            if future is not None:
                run.settler.put(future, None, error)

        try:
            self._step_or_skip(run, plan, deliver, fail)
        finally:
            if quiet is not None:
                quiet.step_done()

    def _step_or_skip(self, run: RunState, plan: StagePlan,
                      deliver: Callable[[StageOutcome], None],
                      fail: Callable[[BaseException], None]) -> None:
        """Worker thread: `_run_step`'s step (see there)."""
        leader = self.leader
        if run.stopped or self._superseded(run):
            if leader.overlaps:
                with contextlib.suppress(Exception):  # the run is over either way
                    leader.flush(deliver)
            fail(SkippedStep())
            return
        try:
            if leader.overlaps:
                leader.step_overlapped(plan, deliver, lambda: self._submitted > self._started)
            else:
                deliver(leader.run_step(plan))
        except BaseException as e:
            run.stopped = True
            fail(e)
            if not isinstance(e, Exception):
                raise

    def _superseded(self, run: RunState) -> bool:
        return run.generation != self._run_generation or self.draining

    def _failed(self, step_id: int, e: Exception) -> pb.StepResult:
        if isinstance(e, PlanError):  # refused before any compute: no traceback
            log.error("step %d refused: %s", step_id, e)
        else:
            log.error("step %d failed", step_id, exc_info=e)
        return error_to_proto(step_id, f"stage {self.identity.stage_index}: "
                                       f"{type(e).__name__}: {e}")

    async def Assign(self, request: pb.AssignRequest,
                     context: grpc.aio.ServicerContext) -> pb.DescribeResponse:
        i = self.identity
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this stage is not a standby: it is stage {i.stage_index} of "
                            f"{i.num_stages} (layers {i.layer_start}-{i.layer_end - 1})")
        raise AssertionError("unreachable")

    async def Drain(self, request: pb.DrainRequest,
                    context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        self.draining = True
        dropped = await self._call(self.leader.reset)
        return pb.DrainResponse(dropped_sequences=int(dropped))  # type: ignore[call-overload]

    def close(self) -> None:
        self.leader.interrupt(self.leader.links.epoch, "the stage is shutting down")
        self._worker.submit(self.leader.shutdown).result(timeout=30)
        self._worker.shutdown(wait=True)
