"""``Scheduler``: continuous batching for the router, over logical KV blocks."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvcache import BlockHashChain, KVCacheConfig, KVCacheManager, KVCacheUsage
from router.scheduler.admission import check_admission, validate_request
from router.scheduler.config import SchedulerConfig
from router.scheduler.integrity import check_scheduler_integrity
from router.scheduler.plan import StepPlan, StepUpdate
from router.scheduler.result import apply_step_result
from router.scheduler.sequence import ChoiceSpec, FinishReason, SeqState, Sequence
from router.scheduler.state import SchedulerState
from router.scheduler.step_builder import StepBuilder


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot for metrics and logs."""

    num_waiting: int
    num_running: int
    num_outstanding_steps: int
    num_preemptions: int
    num_steps: int
    kv: KVCacheUsage
    run_ahead_depth: int  # steps of one sequence planned ahead in steady decode (1: none)


class Scheduler:
    """Decides, step after step, which sequences compute which tokens in which blocks.

    Pure Python and single-threaded: the router calls it from one task. A step's life:
    ``schedule()`` returns a ``StepPlan`` (and records the step as outstanding); the plan goes
    to every stage; the last stage's sampled tokens come back through ``update()``, in step
    order; the caller checks stop rules on the new tokens and reports endings through
    ``finish()`` (or ``abort()``). Up to ``max_outstanding_steps`` steps may be outstanding.
    """

    def __init__(self, config: SchedulerConfig, kv_config: KVCacheConfig) -> None:
        """Build an empty scheduler. ``kv_config.num_blocks`` is the minimum over the stages.

        Raises:
            ValueError: one sequence of ``max_model_len`` tokens would not fit the pool.
        """
        self.config = config
        self._state = SchedulerState(config, kv_config)
        self._arrivals = itertools.count()
        self._depth = config.max_steps_per_seq  # 1 without run-ahead

    @property
    def run_ahead_depth(self) -> int:
        """With run-ahead, the steps of one sequence planned ahead in steady decode: from 2 up
        to ``config.run_ahead_depth`` (the most, and the default). The caller may set it
        between steps (the engine core paces it by how fast steps come back); steps already
        outstanding past a lower depth are answered as usual, and no new one is planned until
        fewer are outstanding.

        Raises:
            ValueError: set outside [2, config.run_ahead_depth], or without run-ahead.
        """
        return self._depth

    @run_ahead_depth.setter
    def run_ahead_depth(self, depth: int) -> None:
        most = self.config.max_steps_per_seq
        if not self.config.run_ahead:
            raise ValueError("run_ahead_depth is set only with run-ahead on")
        if not 2 <= depth <= most:
            raise ValueError(f"run_ahead_depth must be in [2, {most}], got {depth}")
        self._depth = depth

    @property
    def kv_cache(self) -> KVCacheManager:
        """The block manager: ask its queries (``usage``, ``block_ids``...); mutate it only
        through the scheduler."""
        return self._state.kv

    @property
    def num_waiting(self) -> int:
        """Sequences in the waiting queue (new or preempted)."""
        return len(self._state.waiting)

    @property
    def num_running(self) -> int:
        """Sequences holding blocks."""
        return len(self._state.running)

    @property
    def num_outstanding_steps(self) -> int:
        """Steps planned and not yet answered by ``update``."""
        return len(self._state.inflight)

    @property
    def outstanding_limit(self) -> int:
        """Steps that may be outstanding now. The full run-ahead depth (P x depth) only
        while every sequence decodes; while requests wait to be admitted, or an outstanding
        step carries prompt work, at most P x 2: a request that arrives then is planned
        within two steps, not behind up to P x depth steps planned before it came (prefill
        steps are the long ones). Deeper run-ahead is for the steady decode it speeds up. In
        steady decode the depth is ``run_ahead_depth`` (at most the config's)."""
        config, state = self.config, self._state
        if config.run_ahead and (state.waiting or state.inflight.num_prefill):
            return config.max_inflight_steps * 2
        return config.max_inflight_steps * self._depth

    @property
    def has_capacity(self) -> bool:
        """Whether ``schedule()`` may plan another step now."""
        return len(self._state.inflight) < self.outstanding_limit

    @property
    def settled(self) -> bool:
        """Whether the stages know all the scheduler does: no step outstanding, and no
        notice (a sequence whose stage state is to be dropped) or block copy waiting for a
        plan to carry it."""
        state = self._state
        return not (state.inflight or state.notices or state.block_copies)

    @property
    def has_unfinished(self) -> bool:
        """Whether any sequence is live (waiting, running or a pending choice)."""
        return bool(self._state.seqs)

    def add_request(
        self,
        seq_id: int,
        prompt_token_ids: Iterable[int],
        sampling: object,
        *,
        priority: int = 0,
        extra_choices: Iterable[ChoiceSpec] = (),
        extra_key: bytes | None = None,
        read_prefix_cache: bool = True,
    ) -> None:
        """Queue a request.

        Args:
            seq_id: unique among live sequences.
            prompt_token_ids: the prompt, at least one token.
            sampling: opaque; handed to the last stage in the plan that first sends the sequence.
            priority: lower runs first; equal priorities run first come, first served.
            extra_choices: further sequences of the same request (``n > 1``): the prompt is
                computed once, then each choice forks off it (sharing its blocks) and samples
                its own first token from the last prompt position.
            extra_key: mixed into prefix-cache hashes (e.g. an adapter id), None for none.
            read_prefix_cache: False computes every prompt position even where the prefix
                cache holds it (the last stage needs their logits for prompt logprobs); the
                request's blocks are still cached for others.

        Raises:
            InvalidRequestError: empty prompt, no room for a generated token within
                ``max_model_len``, or more choices than can run.
            DuplicateSeqIdError: a sequence id is repeated or already live.
            AdmissionRefusedError: the queue is at its request or token limit.

        Mutates: queues the sequence (and registers its choices).
        """
        prompt = list(prompt_token_ids)
        choices = tuple(extra_choices)
        state = self._state
        validate_request(self.config, prompt, seq_id, choices, state.seqs)
        check_admission(self.config, state.waiting, len(prompt))
        arrival = next(self._arrivals)
        chain = BlockHashChain(state.kv.block_size, extra_key)
        seq = Sequence(seq_id, prompt, sampling, priority, (priority, arrival, 0), chain)
        seq.reads_cache = read_prefix_cache
        seq.free_notice_pending = seq_id in state.notices  # an old holder of this id
        for index, choice in enumerate(choices, start=1):
            child = Sequence(choice.seq_id, list(prompt), choice.sampling, priority,
                             (priority, arrival, index), chain)
            child.state = SeqState.CHOICE_PENDING
            child.parent = seq
            child.free_notice_pending = choice.seq_id in state.notices
            seq.extra_choices.append(child)
            state.seqs[child.seq_id] = child
        state.seqs[seq_id] = seq
        state.waiting.push(seq)

    def schedule(self) -> StepPlan | None:
        """Plan the next step.

        Returns:
            The plan, or None when ``outstanding_limit`` steps are outstanding or there is
            nothing to compute and nothing to tell the stages. Every plan returned must be
            answered by exactly one ``update`` call, in step order.

        Mutates: sequences, the KV pool and the outstanding steps (see ``StepBuilder``).
        """
        if not self.has_capacity:
            return None
        return StepBuilder(self._state).build()

    def update(self, step_id: int, sampled: Mapping[int, int]) -> StepUpdate:
        """Apply the result of the oldest outstanding step.

        Args:
            step_id: the step answered; must be the oldest outstanding one.
            sampled: seq_id -> token for exactly the sequences the plan marked ``sample``.

        Returns:
            The tokens appended, the ones discarded (sequences ended or preempted since the plan)
            and the sequences finished for reaching ``max_model_len``.

        Raises:
            InvalidStepResultError: wrong step or a token missing or unexpected; nothing changed.

        Mutates: appends tokens, marks sequences no longer in flight, caches full blocks,
        queues forks, frees length-capped sequences.
        """
        return apply_step_result(self._state, step_id, sampled)

    def finish(self, seq_id: int, reason: FinishReason) -> bool:
        """End a sequence in whatever state it is.

        Its blocks are freed now, once; its tokens in steps still outstanding are discarded
        (a finish learned late gives back the surplus run-ahead slots); the next plan tells the
        stages (``aborted_seq_ids`` for ABORT, ``finished_seq_ids`` for STOP and LENGTH).
        Pending extra choices of a request whose prompt is unfinished end with it.

        Returns:
            False if ``seq_id`` is not live (already finished or never added); nothing changes.
        """
        seq = self._state.seqs.get(seq_id)
        if seq is None:
            return False
        self._state.release(seq, reason)
        return True

    def abort(self, seq_id: int) -> bool:
        """``finish(seq_id, FinishReason.ABORT)``: safe to call any number of times."""
        return self.finish(seq_id, FinishReason.ABORT)

    def preempt_all(self) -> int:
        """Recover from a lost stage: preempt every running sequence, forget outstanding steps
        (their results are then refused) and empty the prefix cache (the stage lost its KV).

        Sequences keep their tokens and resume, by recompute, with identical results.
        Returns how many sequences were preempted.
        """
        state = self._state
        victims = list(state.running)
        for seq in reversed(victims):
            state.preempt(seq)
        state.inflight.forget_all()
        state.fork_ready.clear()
        state.block_copies.clear()
        state.kv.reset_prefix_cache()
        return len(victims)

    def get_state(self, seq_id: int) -> SeqState | None:
        """The state of a live sequence, None once it finished (or if never added)."""
        seq = self._state.seqs.get(seq_id)
        return seq.state if seq is not None else None

    def get_token_ids(self, seq_id: int) -> tuple[int, ...]:
        """Known tokens (prompt + generated) of a live sequence. Raises KeyError if not live."""
        return tuple(self._state.seqs[seq_id].token_ids)

    def stats(self) -> SchedulerStats:
        """Counts for metrics. O(1)."""
        state = self._state
        return SchedulerStats(
            num_waiting=len(state.waiting), num_running=len(state.running),
            num_outstanding_steps=len(state.inflight), num_preemptions=state.num_preemptions,
            num_steps=state.next_step_id, kv=state.kv.usage(),
            run_ahead_depth=self._depth,
        )

    def check_integrity(self) -> None:
        """Verify every invariant of the scheduler and its KV pool (tests; O(everything)).

        Raises:
            IntegrityError: with the first inconsistency found.
        """
        check_scheduler_integrity(self._state)
