"""The stage leader (TP rank 0): what only rank 0 does around the step every rank runs.

Per plan: check it against the stage's limits and held sequences (a refused plan reaches no
other rank); resolve its run-ahead inputs (the first stage of several waits for them on the
feedback link, see `feedback`); receive the step's activations from upstream; fan the plan
and those inputs out to the other TP ranks (`tp_fanout`); run `StageRank.step`; then send
the output downstream or, on the last stage, sample, wait once for the sampled ids' host
copy, record them and send them back to the first stage. The outcome answers the router.
Synchronous; the gRPC service calls it from one worker thread.

The first stage of several at TP size 1 takes its run-ahead inputs late (`feeds_late`): it
applies the plan, lays the step out and uploads it, and only then waits for the tokens the
last stage fed back, writes them into the step's token ids on the device and launches. When
stages share one GPU with one micro-batch between them, that wait is all the host work
between the last stage's sampling and this stage's next step on the GPU.

A one-stage pipeline at TP size 1 overlaps steps (`step_overlapped`): when the next plan is
already queued, it queues that step's forward pass on the GPU before waiting for the
previous step's tokens, so the host prepares step k+1 while the GPU runs step k. Step k+1
reads its run-ahead inputs from the ids step k left on the device; its host history gets
them when step k resolves, before step k+1 samples (penalties and seeded draws see them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from foundation.tracing import context_from_headers, tracer
from stage_worker import tp_fanout
from stage_worker.dataplane import DataPlaneConfig, TransportKind
from stage_worker.dataplane.compression import (
    CompressedFormError,
    Compression,
    compress,
    decompress,
)
from stage_worker.feedback import FeedbackInbox, FeedbackStore, StepTokens
from stage_worker.links import (
    DataPlaneAddress,
    DataPlaneLinks,
    nccl_device,
    offered_transports,
    ring_config,
)
from stage_worker.metrics import StageMetrics, StepWindow
from stage_worker.plan import PromptLogprobs, SampledToken, StageOutcome, StagePlan
from stage_worker.stage_rank import LateInputs, StageRank
from stage_worker.step_input import SeqChunk
from stage_worker.step_sampling import StepSample


class ActivationMismatchError(ValueError):
    """Upstream sent activations that do not fit the step's plan (shape or dtype)."""


@dataclass(frozen=True)
class _Sampling:
    """A last stage's step whose sampling is queued on the device, tokens not yet read."""

    step_id: int
    sample: StepSample | None  # None: the step sampled nothing
    prompt: tuple[PromptLogprobs, ...] = ()  # the step's prompt log probabilities


class StageLeader:
    """Owns TP rank 0's `StageRank`, the data-plane links and the TP fan-out."""

    def __init__(self, rank: StageRank, step_timeout_s: float,
                 dataplane: DataPlaneAddress | None = None,
                 compression: Compression = Compression.NONE, transport: str = "auto",
                 dataplane_config: DataPlaneConfig | None = None) -> None:
        """`dataplane`: where the listeners bind (default: the router's name).
        `compression`: the form of the activations sent downstream (the receiver reads any).
        `transport`: what the stage offers for activation links ("auto", "tcp", "unix",
        "cuda_ipc", "nccl"; see `offered_transports`). Raises ValueError where the one asked
        for cannot work.
        `dataplane_config`: the links' limits and TLS (default: plaintext, default limits)."""
        self.rank = rank
        self.step_timeout_s = step_timeout_s
        self.compression = compression
        self.feedback = FeedbackStore()  # first stage: the run-ahead inputs
        inbox = FeedbackInbox(self.feedback)
        shape = rank.shape
        ring = None if transport in ("tcp", "nccl") else ring_config(
            shape.device, rank.limits.max_num_batched_tokens, shape.hidden_size, shape.dtype)
        tls = dataplane_config is not None and dataplane_config.tls is not None
        nccl = nccl_device(shape.device, transport, tls)
        self.transports = offered_transports(transport, ring, nccl)
        self.links = DataPlaneLinks(dataplane or DataPlaneAddress(), step_timeout_s,
                                    on_feedback=inbox.attach, ring=ring,
                                    config=dataplane_config, nccl_device=nccl)
        self._pending: _Sampling | None = None  # `step_overlapped`: sampled, not resolved
        self._late_wait = 0.0  # `feeds_late`: this step's wait for its run-ahead tokens
        self.steps_overlapped = 0  # steps queued on the GPU before the previous one resolved
        self.window = StepWindow()  # the last seconds of steps, for Describe
        self.metrics: StageMetrics | None = None  # set by the stage's entry point

    @property
    def overlaps(self) -> bool:
        """Whether steps run through `step_overlapped`: a one-stage pipeline, TP size 1."""
        rank = self.rank
        return rank.is_first and rank.is_last and rank.tp.size == 1

    @property
    def feeds_late(self) -> bool:
        """Whether run-ahead inputs are written late, after the step's host work (see the
        module's docstring): the first stage of several, TP size 1 (other ranks would need
        the tokens before the step)."""
        rank = self.rank
        return rank.is_first and not rank.is_last and rank.tp.size == 1

    def listen_upstream(self, router_host: str, token: bytes, epoch: int,
                        kind: TransportKind = TransportKind.TCP) -> str:
        """See `DataPlaneLinks.listen_upstream`. The service refuses a `kind` the stage
        does not offer (`transports`) before it calls this."""
        return self.links.listen_upstream(router_host, token, epoch, kind)

    def connect_downstream(self, address: str, token: bytes, epoch: int,
                           kind: TransportKind = TransportKind.TCP) -> None:
        self.links.connect_downstream(address, token, epoch, kind)

    def listen_feedback(self, router_host: str, token: bytes, epoch: int,
                        kind: TransportKind = TransportKind.TCP) -> str:
        """First stage: see `DataPlaneLinks.listen_feedback`."""
        if not self.rank.is_first or self.rank.is_last:
            raise ValueError("only the first stage of a pipeline of several listens for "
                             "feedback")
        return self.links.listen_feedback(router_host, token, epoch, kind)

    def connect_feedback(self, address: str, token: bytes, epoch: int,
                         kind: TransportKind = TransportKind.TCP) -> None:
        """Last stage: see `DataPlaneLinks.connect_feedback`."""
        if not self.rank.is_last or self.rank.is_first:
            raise ValueError("only the last stage of a pipeline of several sends feedback")
        self.links.connect_feedback(address, token, epoch, kind)

    @property
    def linked(self) -> bool:
        """Whether every link this stage needs is up (none for a single-stage pipeline)."""
        up_ok = self.rank.is_first or self.links.has_upstream
        down_ok = self.rank.is_last or self.links.has_downstream
        return up_ok and down_ok

    def run_step(self, plan: StagePlan) -> StageOutcome:
        """Run one step on every TP rank; send the activations on, or sample.

        Raises:
            PlanError: the plan exceeds the stage's limits or contradicts its state
                (nothing ran; no other rank saw it).
            FeedbackMissingError: (first stage) a run-ahead input's tokens did not come.
            LinkNotReadyError, TransportError, ActivationMismatchError: the upstream
                activations did not come as planned (no other rank saw the plan).
        """
        started, started_ns = time.perf_counter(), time.time_ns()
        sent: tuple[str, float] | None = None
        rank = self.rank
        rank.check(plan)
        late = self._late_inputs(plan.step_id) if self.feeds_late else None
        fed = {} if late is not None else self._run_ahead_inputs(plan)
        upstream = None if rank.is_first else self._receive(plan)
        waited = time.perf_counter() - started
        tp_fanout.send_plan(rank.tp, plan, fed)
        on_device = self.feedback if rank.is_first and rank.is_last else None
        self._late_wait = 0.0
        chunks, out = rank.step(plan, upstream, fed, on_device, late=late)
        waited += self._late_wait
        if rank.is_last:
            outcome = self._resolve(self._start_sampling(plan.step_id, chunks, out))
        else:
            if out is None:  # nothing computed: the next stage still expects this step
                out = torch.empty(0, rank.shape.hidden_size, dtype=rank.shape.dtype)
            sending = time.perf_counter()
            self.links.send(plan.step_id, compress(out, self.compression))
            kind = self.links.downstream_kind
            sent = (kind.value if kind else "", time.perf_counter() - sending)
            if self.metrics is not None:
                self.metrics.sent(*sent)
            outcome = self._outcome(plan.step_id)
        if rank.is_first and not rank.is_last:  # a step that read no feedback takes it in
            self.feedback.settle(self.step_timeout_s)
        busy = time.perf_counter() - started - waited
        self.window.add(waited, busy)
        if self.metrics is not None:
            self.metrics.step(plan.num_tokens, waited, busy)
        if plan.traceparent:
            self._trace_step(plan, started_ns, waited, busy, sent)
        return outcome

    def step_overlapped(self, plan: StagePlan, deliver: Callable[[StageOutcome], None],
                        more_coming: Callable[[], bool]) -> None:
        """`run_step` for a one-stage pipeline (`overlaps`), overlapping steps.

        Queues `plan`'s forward pass, then resolves the step left pending by the previous
        call (its outcome to `deliver`), then queues `plan`'s sampling. If `more_coming()`
        says another plan is already queued, `plan`'s step is left pending for that call;
        otherwise it is resolved and delivered now. Outcomes are delivered in step order;
        an error raised here is `plan`'s (the pending step is delivered first).
        """
        started, started_ns = time.perf_counter(), time.time_ns()
        pending, self._pending = self._pending, None
        self.steps_overlapped += pending is not None
        try:
            self.rank.check(plan)
            deferred = pending is not None and pending.sample is not None
            fed = self._run_ahead_inputs(plan, None if pending is None else pending.step_id)
            chunks, out = self.rank.step(plan, None, fed, self.feedback, deferred)
        finally:
            if pending is not None:
                deliver(self._resolve(pending))
        sampling = self._start_sampling(plan.step_id, chunks, out)
        if more_coming():
            self._pending = sampling
        else:
            deliver(self._resolve(sampling))
        busy = time.perf_counter() - started  # one stage: its inputs are its own, no wait
        self.window.add(0.0, busy)
        if self.metrics is not None:
            self.metrics.step(plan.num_tokens, 0.0, busy)
        if plan.traceparent:
            self._trace_step(plan, started_ns, 0.0, busy, None)

    def _trace_step(self, plan: StagePlan, started_ns: int, waited: float, busy: float,
                    sent: tuple[str, float] | None) -> None:
        """A traced request's step (its first prefill chunk) as a span of its trace: when the
        step began and ended on this stage, its wait for input, and its hop."""
        t = tracer()
        if t is None:
            return
        layers = self.rank.shape.layers
        attributes: dict[str, str | int | float] = {
            "stagemesh.step.id": plan.step_id, "stagemesh.step.tokens": plan.num_tokens,
            "stagemesh.step.sequences": plan.num_seqs,
            "stagemesh.stage.layers": f"{layers.start}-{layers.end - 1}",
            "stagemesh.stage.input_wait_ms": waited * 1e3,
            "stagemesh.stage.step_ms": busy * 1e3}
        if sent is not None:
            attributes["stagemesh.hop.transport"] = sent[0]
            attributes["stagemesh.hop.send_ms"] = sent[1] * 1e3
        span = t.start_span(f"stage step (layers {layers.start}-{layers.end - 1})",
                            context_from_headers({"traceparent": plan.traceparent}),
                            attributes=attributes, start_time=started_ns)
        span.end(end_time=started_ns + int((waited + busy) * 1e9))

    def flush(self, deliver: Callable[[StageOutcome], None]) -> None:
        """Resolve and deliver the step `step_overlapped` left pending, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            deliver(self._resolve(pending))

    def _late_inputs(self, step_id: int) -> LateInputs:
        """`feeds_late`: step `step_id`'s run-ahead tokens, waited for on the feedback link
        (FeedbackMissingError when they do not come, as `_run_ahead_inputs`); the wait is
        the step's, not its work."""
        def take(seq_ids: tuple[int, ...], steps: tuple[int, ...]) -> tuple[int, ...]:
            waiting = time.perf_counter()
            try:
                return self.feedback.take_aligned(step_id, seq_ids, steps, self.step_timeout_s)
            finally:
                self._late_wait += time.perf_counter() - waiting
        return take

    def _run_ahead_inputs(self, plan: StagePlan, unresolved: int | None = None
                          ) -> dict[int, int]:
        """seq_id -> token of every run-ahead input, where the stage keeps tokens: the last
        stage sampled it (the check made sure of the step); the first stage of several
        waits for it from the feedback link. Inputs sampled at step `unresolved` (whose
        tokens are still on the device) are left out."""
        rank = self.rank
        if not rank.held.keep_tokens:
            return {}
        if rank.is_last:
            if rank.continues_lane(plan):  # the lane reads the tokens it sampled
                return {}
            seqs = rank.held.seqs
            return {seq_id: seqs[seq_id].output_ids[-1]
                    for seq_id, _, _, _, _, _, k in plan.cached_seqs
                    if k is not None and k != unresolved}
        ahead = [(c.seq_id, c.input_from_step) for c in plan.cached_seqs
                 if c.input_from_step is not None]
        if not ahead:
            return {}
        return self.feedback.take(plan.step_id, ahead, self.step_timeout_s)

    def _start_sampling(self, step_id: int, chunks: list[SeqChunk],
                        scores: torch.Tensor | None) -> _Sampling:
        """Last stage: queue the sampling of the step's scores (None: nothing computed);
        a one-stage pipeline keeps the ids on the device for its run-ahead inputs."""
        rank = self.rank
        if scores is None:
            if rank.is_first:
                self.feedback.put(StepTokens(step_id, (), ()))
            return _Sampling(step_id, None)
        sample = rank.sample(chunks, scores)
        rank.held.note_sampling(step_id, sample.seq_ids)
        if rank.is_first:
            self.feedback.put(StepTokens(step_id, sample.seq_ids, None, sample.token_ids))
        return _Sampling(step_id, sample,
                         rank.prompt_logprobs(chunks, scores, len(sample.seq_ids)))

    def _resolve(self, sampling: _Sampling) -> StageOutcome:
        """Last stage: wait once for the tokens' host copy, record them and send them to
        the first stage (every step, sampling or not)."""
        rank = self.rank
        seq_ids: tuple[int, ...] = ()
        token_ids: tuple[int, ...] = ()
        logprobs: tuple[SampledToken, ...] = ()
        if sampling.sample is not None:
            ids, logprobs = sampling.sample.resolve()
            seq_ids, token_ids = sampling.sample.seq_ids, tuple(ids)
        if not rank.is_first:  # first: the first stage may be waiting for them to step
            self.links.send_feedback(sampling.step_id, seq_ids, token_ids)
        if seq_ids:
            rank.held.record_sampled(sampling.step_id, seq_ids, token_ids)
        return self._outcome(sampling.step_id, seq_ids, token_ids, logprobs, sampling.prompt)

    def _outcome(self, step_id: int, seq_ids: tuple[int, ...] = (),
                 token_ids: tuple[int, ...] = (),
                 logprobs: tuple[SampledToken, ...] = (),
                 prompt: tuple[PromptLogprobs, ...] = ()) -> StageOutcome:
        held = self.rank.held
        return StageOutcome(step_id, seq_ids, token_ids, logprobs, held.kv_blocks_used,
                            len(held.seqs), prompt)

    def _receive(self, plan: StagePlan) -> torch.Tensor:
        """The step's activations [T, H] from upstream (in any form `compress` makes),
        checked against the plan, in this stage's dtype."""
        tensors = self.links.recv(plan.step_id)
        want = (plan.num_tokens, self.rank.shape.hidden_size)
        try:
            return decompress(tensors, want, self.rank.shape.dtype)
        except CompressedFormError as e:
            raise ActivationMismatchError(f"step {plan.step_id}: upstream activations do not "
                                          f"fit the plan: {e}") from None

    def interrupt(self, epoch: int, reason: str) -> None:
        """Any thread: a step blocked waiting for run-ahead tokens or for activations of the
        links of `epoch` fails now instead of at the step timeout (the Run stream that fed
        it ended: those never come, and the step thread must be free for the next router's
        calls). Links of a newer epoch are left alone."""
        self.feedback.break_with(reason)
        self.links.close_epoch(epoch)

    def reset(self) -> int:
        """Drop all sequence state on every rank (the Run stream ended), a pending step
        included; returns how many sequences this stage held."""
        self._pending = None
        tp_fanout.send_reset(self.rank.tp)
        self.feedback.clear()
        return self.rank.reset()

    def shutdown(self) -> None:
        """Stop the other TP ranks and close the links."""
        tp_fanout.send_shutdown(self.rank.tp)
        self.links.close()
