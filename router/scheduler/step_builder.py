"""Builds one ``StepPlan``: the scheduling policy lives here.

Order within a step, under one budget of ``max_num_batched_tokens`` tokens and
``max_num_seqs`` sequences:
  0. fork the pending choices of parents whose shared prompt is computed;
  1. running decodes, in priority-then-arrival order; with P > 1 at most ``ceil(running / P)``
     of them, so the P in-flight micro-batches stay balanced. A decode that finds no free
     block preempts the newest running sequence (possibly itself) and retries;
  2. the next chunk of partly prefilled running sequences (chunked prefill), as far as the
     budget and the free blocks go; no preemption;
  3. if nobody was preempted: waiting sequences, best first, with their prefix-cache hits,
     until one does not fit (head of line: nothing overtakes it, so nobody waits for ever).
     A preempted sequence comes back only after the plan telling the stages, and only once
     no step it was in is outstanding, so in-flight steps never share a sequence.
  4. if nothing is planned, nobody was preempted and no step is outstanding, the newest
     running sequence is preempted: the others wait on blocks only they hold (see
     ``_break_stall``).
A sequence is eligible when it is in no outstanding step, or, with run-ahead, in exactly one
that is at least P steps older (so P consecutive steps never share a sequence).
"""

from __future__ import annotations

from router.scheduler.inflight import InflightStep
from router.scheduler.plan import CachedSeq, NewSeq, StepPlan
from router.scheduler.sequence import SeqState, Sequence
from router.scheduler.state import SchedulerState

_new_tuple = tuple.__new__  # builds a CachedSeq without the NamedTuple's Python-level __new__


class StepBuilder:
    """Plans the step ``state.next_step_id``; use once: ``StepBuilder(state).build()``."""

    __slots__ = ("block_size", "cached_seqs", "kv", "new_seqs", "preempted", "sampling",
                 "seq_budget", "silent", "state", "step_id", "to_cache", "token_budget")

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.kv = state.kv
        self.step_id = state.next_step_id
        self.token_budget = state.config.max_num_batched_tokens
        self.seq_budget = state.config.max_num_seqs
        self.block_size = state.kv.block_size
        self.new_seqs: list[NewSeq] = []
        self.cached_seqs: list[CachedSeq] = []
        self.sampling: list[Sequence] = []
        self.silent: list[Sequence] = []
        self.to_cache: list[Sequence] = []
        self.preempted = False

    def build(self) -> StepPlan | None:
        """Plan the step and record it as outstanding.

        Returns:
            The plan, or None (nothing changed, the step id unused) when there is nothing to
            compute and nothing to tell the stages.

        Mutates: sequences (token and block counts, states), the KV pool, the outstanding
        steps.
        """
        self._fork_ready_parents()
        deferred = self._schedule_decodes()
        self._schedule_chunks(deferred)
        if not self.preempted:
            self._admit_waiting()
            if not (self.new_seqs or self.cached_seqs):
                self._break_stall()
        return self._finish()

    def _break_stall(self) -> None:
        """Nothing could be planned and nobody was preempted. With no step outstanding either,
        the running sequences wait for blocks only they hold: parents for the block a fork
        copies into, prefill chunks for room (neither phase preempts). Nothing would change
        before a caller's finish or abort, so preempt the newest running sequence, as a decode
        short of a block does; its blocks serve the older ones from the next step.
        """
        state = self.state
        if state.running and not state.inflight:
            state.preempt(state.running[-1])
            self.preempted = True

    def _fork_ready_parents(self) -> None:
        state = self.state
        still_waiting: list[Sequence] = []
        for parent in state.fork_ready:
            ready = (parent.state is SeqState.RUNNING and parent.extra_choices
                     and not parent.num_inflight and parent.num_computed == parent.compute_limit)
            if ready and not state.fork_choices(parent):
                still_waiting.append(parent)
        state.fork_ready = still_waiting

    def _schedule_decodes(self) -> list[Sequence]:
        """Phase 1. Returns the eligible running sequences that are not decodes, in order.

        The scheduler's hot path (every running sequence, every step): a decode that has room
        goes straight to ``_emit``; only one that needs a block goes through ``_reserve``.
        """
        running, config = self.state.running, self.state.config
        # budget <= max_num_seqs <= max_num_batched_tokens: decodes never run out of tokens.
        budget = min(self.seq_budget, -(-len(running) // config.max_inflight_steps))
        max_len, emit = config.max_model_len, self._emit
        # Eligible (see the module): in no outstanding step, or in fewer than
        # max_steps_per_seq of them, the newest at least P steps old.
        step_id, max_steps, gap = self.step_id, config.max_steps_per_seq, config.max_inflight_steps
        num_decodes = 0
        deferred: list[Sequence] = []
        for seq in running:  # preemption pops from the end only: the iterator stops sooner
            inflight = seq.num_inflight
            if inflight and (inflight >= max_steps or step_id - seq.last_step_id < gap):
                continue
            start = seq.num_computed
            if start + 1 != len(seq.token_ids) + seq.num_pending or seq.extra_choices:
                deferred.append(seq)
                continue
            if num_decodes == budget or start + 1 >= max_len:
                continue  # (at max_len it awaits its last token)
            new_block_ids = () if start < seq.num_slots else self._reserve(seq, start + 1)
            if new_block_ids is None:
                continue  # it was the newest: preempted to make room for older ones
            emit(seq, 1, True, new_block_ids)
            num_decodes += 1
        self.token_budget -= num_decodes
        self.seq_budget -= num_decodes
        return deferred

    def _reserve(self, seq: Sequence, num_tokens: int) -> tuple[int, ...] | None:
        """Grow running ``seq`` to ``num_tokens`` slots, preempting the newest running
        sequences while the pool is short.

        Returns:
            The ids of the blocks appended, or None if ``seq`` itself had to be preempted.
        """
        state = self.state
        while (grown := self.kv.append_slots(seq.seq_id, num_tokens)) is None:
            victim = state.running[-1]  # newest; never one already in this step (see module)
            state.preempt(victim)
            self.preempted = True
            if victim is seq:
                return None
        seq.num_slots = grown.num_slots
        return grown.new_block_ids

    def _schedule_chunks(self, deferred: list[Sequence]) -> None:
        """Phase 2: prefill chunks of running sequences, shrunk to the free blocks."""
        kv = self.kv
        for seq in deferred:
            if not self.seq_budget or not self.token_budget:
                return
            if seq.state is not SeqState.RUNNING:
                continue  # preempted by a decode of this step
            start = seq.num_computed
            room = seq.num_slots - start + kv.num_available_blocks * self.block_size
            num_new = min(seq.compute_limit - start, self.token_budget, room)
            if num_new <= 0:
                continue
            grown = kv.append_slots(seq.seq_id, start + num_new)
            assert grown is not None, "room was computed from the free blocks"
            seq.num_slots = grown.num_slots
            self._emit(seq, num_new, start + num_new == seq.num_total, grown.new_block_ids)
            self.token_budget -= num_new
            self.seq_budget -= 1

    def _admit_waiting(self) -> None:
        """Phase 3: start waiting sequences in queue order until one does not fit."""
        state = self.state
        oldest = state.inflight.oldest_step_id
        while self.seq_budget and self.token_budget:
            seq = state.waiting.peek()
            if seq is None or seq.free_notice_pending:
                return
            if oldest is not None and seq.last_step_id >= oldest:
                return  # preempted while in flight: wait until that step is answered
            if len(state.running) + 1 + len(seq.extra_choices) > state.config.max_running_seqs:
                return
            if not self._admit(seq):
                return

    def _admit(self, seq: Sequence) -> bool:
        state, kv = self.state, self.kv
        num_known = len(seq.token_ids)
        # At most num_known - 1 tokens may hit: the last one must run to give logits.
        hit = kv.find_cached_prefix(seq.hash_chain, seq.token_ids,
                                    num_known - 1 if seq.reads_cache else 0)
        num_computed = hit.num_tokens
        fork_now = bool(seq.extra_choices) and num_computed == num_known - 1
        limit = num_known if fork_now else seq.compute_limit
        num_new = min(limit - num_computed, self.token_budget)
        allocation = kv.allocate(seq.seq_id, num_computed + num_new, hit)
        if allocation is None:
            return False
        state.waiting.pop(seq)
        seq.num_computed = num_computed
        state.start_running(seq, allocation)
        if fork_now:
            forked = state.fork_choices(seq)  # full blocks only: shares, never copies
            assert forked
        self._emit(seq, num_new, num_computed + num_new == seq.num_total,
                   allocation.new_block_ids)
        self.token_budget -= num_new
        self.seq_budget -= 1
        return True

    def _emit(self, seq: Sequence, num_new: int, sample: bool,
              new_block_ids: tuple[int, ...]) -> None:
        """Add ``seq`` to the plan: positions ``[num_computed, num_computed + num_new)``.

        The one routine for decodes, prefill chunks and first prefills. A sequence the stages
        know goes as a ``CachedSeq`` diff with ``new_block_ids`` (the blocks the caller just
        appended; every earlier one was sent, which the integrity check holds) and the tokens
        their history lacks; any other goes in full as a ``NewSeq``. Queues ``seq`` for
        prefix-cache registration (at the end of the step) once its next full block is known
        and scheduled: the scheduler's one caching condition. The caller charges the budgets
        (the decode phase once for all its decodes).
        """
        start = seq.num_computed
        end = start + num_new
        tokens = seq.token_ids
        num_known = len(tokens)
        if seq.known_to_stages:
            sent = seq.num_tokens_sent
            item: tuple[object, ...]
            if start < num_known:  # send the inputs the stages' history lacks (maybe none)
                news = (tokens[sent],) if end - sent == 1 else tuple(tokens[sent:end])
                item = (seq.seq_id, new_block_ids, start, num_new, news, None, sample)
            else:  # run-ahead: the input is the token its previous step samples
                item = (seq.seq_id, new_block_ids, start, num_new, (), seq.last_sample_step,
                        sample)
            self.cached_seqs.append(_new_tuple(CachedSeq, item))
            if end > sent:
                seq.num_tokens_sent = end
            if new_block_ids:
                seq.num_block_ids_sent += len(new_block_ids)
        else:
            self._send_in_full(seq, num_new, sample)
        seq.num_computed = end
        seq.num_inflight += 1
        seq.last_step_id = step_id = self.step_id
        if sample:
            seq.num_pending += 1
            seq.last_sample_step = step_id
            self.sampling.append(seq)
        else:
            self.silent.append(seq)
        if (end if end < num_known else num_known) >= seq.next_cache_at:
            self.to_cache.append(seq)

    def _send_in_full(self, seq: Sequence, num_new: int, sample: bool) -> None:
        """The ``NewSeq`` half of ``_emit``: token history and whole block table."""
        block_ids = self.kv.block_ids(seq.seq_id)
        self.new_seqs.append(NewSeq(seq.seq_id, tuple(seq.token_ids), seq.num_prompt_tokens,
                                    seq.sampling, block_ids, seq.num_computed, num_new, sample))
        seq.known_to_stages = True
        seq.num_tokens_sent = len(seq.token_ids)
        seq.num_block_ids_sent = len(block_ids)

    def _finish(self) -> StepPlan | None:
        state = self.state
        # Registered only now, so no sequence of this step hits blocks this step computes.
        for seq in self.to_cache:
            state.cache_full_blocks(seq)
        has_work = bool(self.new_seqs or self.cached_seqs)
        if not (has_work or state.notices or state.block_copies):
            return None
        finished, aborted, preempted = state.take_notices()
        plan = StepPlan(
            step_id=self.step_id, new_seqs=tuple(self.new_seqs),
            cached_seqs=tuple(self.cached_seqs), finished_seq_ids=finished,
            aborted_seq_ids=aborted, preempted_seq_ids=preempted,
            block_copies=tuple(state.block_copies),
        )
        state.block_copies.clear()
        config = state.config  # prompt work: some sequence computes more than one token
        prefill = (config.max_num_batched_tokens - self.token_budget
                   > config.max_num_seqs - self.seq_budget)
        state.inflight.push(InflightStep(self.step_id, self.sampling, self.silent, prefill))
        state.next_step_id += 1
        return plan
