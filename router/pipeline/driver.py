"""The router's side of the pipeline: one control channel and one Run stream per stage.

`Pipeline.start()` describes every stage, checks they form one pipeline, links the data
plane (each stage i > 0 listens, stage i-1 connects to it; with P > 1 stages the first
stage listens and the last connects for the feedback link that carries sampled ids back,
the run-ahead inputs; a fresh token per link) and opens the Run streams. Plans go down
every stream, each stage getting what it reads (`router.pipeline.convert`), the plans the
core has ready together in one message; the last stage answers every step with its sampled
tokens (the answers it has ready together in one message, and while steps are short the
steps whose plans say `hold_answer` with a later step's), the others only a step that
failed. Any broken stream, stage error or step past its timeout marks the pipeline down;
`start()` again brings it back with a new epoch.

Each hop i -> i+1 is linked over the transport `choose_transport` picks from the two stages'
Describe answers and the `transport` asked for (`router.pipeline.transports`); with "auto",
a hop whose CUDA IPC link the stages refuse (UNAVAILABLE, FAILED_PRECONDITION: e.g. the two
processes cannot share GPU memory) is linked over TCP instead. The feedback link is TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from itertools import pairwise

import grpc

from router.pipeline.convert import plans_to_protos
from router.pipeline.outcome import StepOutcome
from router.pipeline.shape import PipelineError, PipelineShape, StageInfo, check_shape
from router.pipeline.stage_client import StageClient, describe_error
from router.pipeline.transports import (
    AUTO,
    TCP,
    TRANSPORT_CHOICES,
    choose_feedback_transport,
    choose_transport,
    describe_hops,
)
from router.scheduler import StepPlan

log = logging.getLogger("stagemesh.router")

START_RETRY_S = 0.5  # between attempts of `Pipeline.start` to bring the stages up
# What a stage answers a Connect whose CUDA IPC, Unix-domain or NCCL link cannot be made on
# its side (no shared GPU memory between the two processes, the peer's handles refused, the
# abstract name out of reach (another network namespace), no NCCL route between the hosts):
# with "auto", that link is made over TCP instead. Any other failure is the pipeline's
# (start() retries).
FALLBACK_CODES = frozenset({grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.FAILED_PRECONDITION})


class PipelineState(Enum):
    STARTING = "starting"
    READY = "ready"
    DOWN = "down"


OutcomeHandler = Callable[[StepOutcome], None]
FailureHandler = Callable[[str], None]


def _ignore_outcome(outcome: StepOutcome) -> None:
    pass


def _ignore_failure(reason: str) -> None:
    pass


def _ignore_count(count: int) -> None:
    pass


class Pipeline:
    """Drives the stages' Run streams. Single event loop; not thread-safe.

    on_outcome: called with the last stage's answer to every plan, in step order.
    on_answered: called after each message of answers, with how many `on_outcome` had.
    on_failure: called once when the pipeline goes down, with the reason.
    transport: the data-plane transport asked for, one of TRANSPORT_CHOICES ("auto",
        "tcp", "unix", "cuda_ipc", "nccl"; see `choose_transport`).
    hop_transports: the transport each hop i -> i+1 uses ("tcp", "unix", "cuda_ipc",
        "nccl"), P - 1
        entries in pipeline order, of the last epoch whose links all came up ([] before
        the first).
    standby: addresses of standby stages (`stage --standby`), used in order: once the
        pipeline ran, a stage that has not answered for `standby_grace_s` while the
        pipeline tries to come back is replaced by the next standby, assigned its place
        (`StageClient.assign`: it loads that layer range), and the pipeline comes up with it.
    """

    def __init__(self, addresses: list[str], connect_timeout_s: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None,
                 stage_token: str = "", transport: str = AUTO,
                 standby: Sequence[str] = (), standby_grace_s: float = 5.0,
                 assign_timeout_s: float = 300.0) -> None:
        if not addresses:
            raise PipelineError("a pipeline needs at least one stage address")
        if transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORT_CHOICES)}, "
                             f"got {transport!r}")
        last = len(addresses) - 1
        self.stages = [StageClient(i, a, i == last, credentials, stage_token)
                       for i, a in enumerate(addresses)]
        self.on_outcome: OutcomeHandler = _ignore_outcome
        self.on_failure: FailureHandler = _ignore_failure
        self.on_answered: Callable[[int], None] = _ignore_count
        self.connect_timeout_s = connect_timeout_s
        self.transport = transport
        self.standby = list(standby)  # not used yet, in order
        self.standby_grace_s = standby_grace_s
        self.assign_timeout_s = assign_timeout_s
        self.takeovers: list[tuple[int, str, str, float]] = []  # stage, old, new, seconds
        self._credentials, self._stage_token = credentials, stage_token
        self._lost_since: dict[int, float] = {}  # stage index -> first failed Describe
        self._deadline = float("inf")  # of the start() under way: bounds every stage call
        self.hop_transports: list[str] = []
        self.state = PipelineState.STARTING
        self.shape: PipelineShape | None = None
        self.epoch = 0
        self._readers: list[asyncio.Task[None]] = []
        self._due: deque[int] = deque()  # step ids sent and not answered, oldest first

    async def start(self, budget_s: float) -> PipelineShape:
        """Describe, validate, link and open streams, retrying until `budget_s` runs out.

        After the first start, a stage that comes back smaller than the pipeline was started
        with (fewer KV blocks, a smaller step) is refused like a stage that is not back.
        Raises PipelineError naming the stage that never answered or does not fit.
        """
        deadline = self._deadline = time.monotonic() + budget_s
        next_log = 0.0
        while True:
            try:
                return await self._start_once()
            except (grpc.aio.AioRpcError, PipelineError) as e:
                # No attempt starts that the budget would cut short: its calls would time out
                # and hide this error (the reason) behind a timeout of the budget's own end.
                if time.monotonic() + START_RETRY_S >= deadline:
                    raise PipelineError(f"pipeline did not come up within {budget_s:.0f}s: "
                                        f"{describe_error(e)}") from e
                if time.monotonic() >= next_log:  # progress, not a line per retry
                    log.info("waiting for stages (%s); %.0fs left", describe_error(e),
                             deadline - time.monotonic())
                    next_log = time.monotonic() + 10.0
                await asyncio.sleep(START_RETRY_S)

    async def _start_once(self) -> PipelineShape:
        self._close_streams()
        infos = await self._describe_all()
        for i, info in enumerate(infos):
            if info.standby:
                raise PipelineError(f"stage at position {i} ({self.stages[i].address}) is a "
                                    "standby holding no layers: list it under "
                                    "--standby-stages, not --stages")
        shape = check_shape(infos)
        if self.shape is not None and (short := shape.covers(self.shape)) is not None:
            raise PipelineError(short)
        self.shape = self.shape or shape
        self.epoch += 1
        self._due = deque()
        await self._link(infos)
        for stage in self.stages:
            stage.open_run()
        self._readers = [asyncio.create_task(self._read(s, self.epoch)) for s in self.stages]
        self.state = PipelineState.READY
        log.info("pipeline ready (epoch %d): %d stage(s), %d KV blocks of %d tokens, steps "
                 "up to %d tokens / %d sequences; %s", self.epoch, shape.num_stages,
                 shape.num_kv_blocks, shape.block_size, shape.max_num_batched_tokens,
                 shape.max_num_seqs, describe_hops(self.hop_transports))
        return self.shape

    def _call_timeout(self, limit_s: float) -> float:
        """A stage call's timeout while the pipeline comes up: at most `limit_s`, and never
        past the start's budget (a call does not outlive the time it was given)."""
        return max(0.05, min(limit_s, self._deadline - time.monotonic()))

    async def _describe_all(self) -> list[StageInfo]:
        """Every stage's Describe; raises the first failure's PipelineError. A stage that
        has failed to answer for `standby_grace_s` (after the pipeline first came up) is
        replaced by a standby first, when one is left."""
        results = await asyncio.gather(*(s.describe(self._call_timeout(self.connect_timeout_s))
                                         for s in self.stages), return_exceptions=True)
        now = time.monotonic()
        lost = []
        for i, r in enumerate(results):
            if isinstance(r, StageInfo):
                self._lost_since.pop(i, None)
            elif isinstance(r, PipelineError):
                lost.append(i)
                self._lost_since.setdefault(i, now)
            else:
                raise r
        if not lost:
            return [r for r in results if isinstance(r, StageInfo)]
        due = [i for i in lost if now - self._lost_since[i] >= self.standby_grace_s]
        if due and self.shape is not None and self.standby:
            replaced = [i for i in due if await self._take_over(i, now - self._lost_since[i])]
            if replaced:
                return await self._describe_all()
        first = results[lost[0]]
        assert isinstance(first, PipelineError)
        raise first

    async def _take_over(self, index: int, lost_s: float) -> bool:
        """Replace stage `index` by the next standby that accepts its place; False when no
        standby is left (each one tried is used up, whether it accepted or not)."""
        assert self.shape is not None
        old = self.stages[index]
        start, end = self.shape.layer_ranges[index]
        while self.standby:
            address = self.standby.pop(0)
            client = StageClient(index, address, old.is_last, self._credentials,
                                 self._stage_token)
            log.warning("stage %d (%s) has not answered for %.1fs: standby %s takes over its "
                        "layers %d-%d", index, old.address, lost_s, address, start, end - 1)
            started = time.monotonic()
            try:
                await client.assign(self.shape, self._call_timeout(self.assign_timeout_s))
            except PipelineError as e:
                log.error("standby %s could not take over stage %d: %s", address, index, e)
                await client.close()
                continue
            self.stages[index] = client
            self._lost_since.pop(index, None)
            self.takeovers.append((index, old.address, address, time.monotonic() - started))
            log.warning("stage %d is now %s (assigned in %.1fs)", index, address,
                        time.monotonic() - started)
            await old.close()
            return True
        log.error("stage %d (%s) is lost and no standby is left", index, old.address)
        return False

    async def _link(self, infos: list[StageInfo]) -> None:
        """Stage i+1 listens, stage i connects, over the transport chosen for that hop from
        `infos` (the stages' Describe answers of this epoch); with more than one stage, the
        first stage listens for the last stage's feedback link (the run-ahead inputs), over
        `choose_feedback_transport`'s. A fresh token per link, per epoch. Sets
        `hop_transports` once every link is up.

        Raises PipelineError (a forced "cuda_ipc" a hop cannot have) or
        grpc.aio.AioRpcError (a link the stages could not make).
        """
        kinds = [choose_transport(up, down, self.transport)
                 for up, down in pairwise(infos)]
        hops: list[str] = []
        for (up, down), kind in zip(pairwise(self.stages), kinds, strict=True):
            hops.append(await self._link_or_fall_back(up, down, kind))
        if len(self.stages) > 1:
            kind = choose_feedback_transport(infos[-1], infos[0], self.transport)
            await self._link_or_fall_back(self.stages[-1], self.stages[0], kind, feedback=True)
        self.hop_transports = hops

    async def _link_or_fall_back(self, up: StageClient, down: StageClient, kind: str,
                                 feedback: bool = False) -> str:
        """`_link_hop`; with "auto", a link other than TCP that the stages could not make
        (`FALLBACK_CODES`) is made over TCP instead. Returns the transport linked."""
        try:
            await self._link_hop(up, down, kind, feedback)
        except grpc.aio.AioRpcError as e:
            if kind == TCP or e.code() not in FALLBACK_CODES or not (
                    self.transport == AUTO or feedback):
                raise
            link = "feedback link" if feedback else f"hop {up.index}->{down.index}"
            log.warning("%s: the %s link failed (%s); linking it over tcp", link, kind,
                        describe_error(e))
            kind = TCP
            await self._link_hop(up, down, kind, feedback)  # the new listen replaces the old
        return kind

    async def _link_hop(self, up: StageClient, down: StageClient, kind: str,
                        feedback: bool = False) -> None:
        """`down` listens over `kind`, `up` connects to it; a fresh token. `feedback`: the
        run-ahead feedback link (`up` the last stage, `down` the first)."""
        token = secrets.token_bytes(32)
        timeout = self._call_timeout(self.connect_timeout_s)
        address = await down.listen(self.epoch, token, timeout, feedback=feedback,
                                    transport=kind)
        await up.connect(self.epoch, token, address, timeout, feedback=feedback,
                         transport=kind)

    async def send(self, plans: Sequence[StepPlan],
                   traces: Mapping[int, str] | None = None,
                   holds: Sequence[bool] = ()) -> None:
        """Write plans of consecutive steps (oldest first) to every stage's stream, one
        message per stage; a broken stream marks the pipeline down. `traces`: step id ->
        the traceparent under which the stages record that step. `holds`: per plan, whether
        the last stage may hold its answer for the next step's (`hold_answer`; the last
        plan's is never held)."""
        if self.state is not PipelineState.READY:
            raise PipelineError("pipeline is not ready")
        messages = plans_to_protos(plans, len(self.stages), traces, holds)
        self._due.extend(plan.step_id for plan in plans)
        try:
            await asyncio.gather(*(stage.write(msg)
                                   for stage, msg in zip(self.stages, messages, strict=True)))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            steps = f"step {plans[0].step_id}" + (f"-{plans[-1].step_id}" if len(plans) > 1
                                                   else "")
            self.mark_down(f"sending {steps}: {describe_error(e)}")

    async def _read(self, stage: StageClient, epoch: int) -> None:
        try:
            while True:
                delivered = 0
                for answer in await stage.read():
                    if answer.error:
                        raise PipelineError(answer.error)
                    if answer.outcome is not None and self._current(epoch):
                        due = self._due.popleft() if self._due else None
                        if answer.step_id != due:  # a confused stage: never guess
                            raise PipelineError(f"answered step {answer.step_id} where step "
                                                f"{due} was due")
                        self.on_outcome(answer.outcome)  # never an answer the core forgot
                        delivered += 1
                if delivered:
                    self.on_answered(delivered)
        except asyncio.CancelledError:
            raise
        except (grpc.aio.AioRpcError, PipelineError) as e:
            if self._current(epoch):
                self.mark_down(f"stage {stage.index} ({stage.address}): {describe_error(e)}")

    def _current(self, epoch: int) -> bool:
        """Whether a reader of `epoch` still speaks for the pipeline (once it went down, the
        core forgot every outstanding step; a late answer of an old stream is dropped)."""
        return epoch == self.epoch and self.state is PipelineState.READY

    def mark_down(self, reason: str) -> None:
        if self.state is PipelineState.DOWN:
            return
        log.error("pipeline down: %s", reason)
        self.state = PipelineState.DOWN
        self.on_failure(reason)

    def _close_streams(self) -> None:
        for task in self._readers:
            task.cancel()
        for stage in self.stages:
            stage.close_run()
        self._readers = []

    async def stage_stats(self, timeout_s: float = 2.0) -> list[StageInfo | None]:
        """Live Describe of every stage (None for a stage that does not answer)."""
        async def one(stage: StageClient) -> StageInfo | None:
            try:
                return await stage.describe(timeout_s)
            except PipelineError:
                return None
        return list(await asyncio.gather(*(one(s) for s in self.stages)))

    async def close(self, drain: bool = True) -> None:
        self.state = PipelineState.DOWN
        self._close_streams()
        for stage in self.stages:
            if drain:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stage.drain(timeout_s=2.0)
            await stage.close()
