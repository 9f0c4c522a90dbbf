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

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.step_id = state.next_step_id
        self.token_budget = state.config.max_num_batched_tokens
        self.seq_budget = state.config.max_num_seqs
        self.block_size = state.kv.block_size
        self.caching = state.kv.config.enable_prefix_caching
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

        Mutates: sequences (token counts, tables, states), the KV pool, the outstanding steps.
        """
        self._fork_ready_parents()
        deferred = self._schedule_decodes()
        self._schedule_chunks(deferred)
        if not self.preempted:
            self._admit_waiting()
        return self._finish()

    def _fork_ready_parents(self) -> None:
        state = self.state
        still_waiting: list[Sequence] = []
        for parent in state.fork_ready:
            ready = (parent.state is SeqState.RUNNING and parent.extra_choices
                     and not parent.num_inflight and parent.num_computed == parent.compute_limit)
            if ready and not state.fork_choices(parent):
                still_waiting.append(parent)
        state.fork_ready = still_waiting

    def _eligible(self, seq: Sequence) -> bool:
        if not seq.num_inflight:
            return True
        config = self.state.config
        return (config.run_ahead and seq.num_inflight == 1
                and self.step_id - seq.last_step_id >= config.max_inflight_steps)

    def _schedule_decodes(self) -> list[Sequence]:
        """Phase 1. Returns the eligible running sequences that are not decodes, in order.

        The common decode (stages know the sequence, a block is free if it needs one) is
        emitted inline rather than through ``_emit``: this loop is the scheduler's hot path.
        """
        running, config = self.state.running, self.state.config
        # budget <= max_num_seqs <= max_num_batched_tokens: decodes never run out of tokens,
        # so the token budget is charged once, after the loop.
        budget = min(self.seq_budget, -(-len(running) // config.max_inflight_steps))
        max_len, step_id, cached = config.max_model_len, self.step_id, self.cached_seqs
        sampling = self.sampling
        cache_unit = self.block_size if self.caching else 1 << 62
        append_slots = self.state.kv.append_slots
        num_slow = num_decodes = 0
        deferred: list[Sequence] = []
        for seq in running:  # preemption pops from the end only: the iterator stops sooner
            if seq.num_inflight and not self._eligible(seq):
                continue
            tokens, start, table = seq.token_ids, seq.num_computed, seq.table
            num_known = len(tokens)
            if start + 1 != num_known + seq.num_pending or seq.extra_choices:
                deferred.append(seq)
                continue
            if num_decodes == budget or start + 1 >= max_len or table is None:
                continue  # (at max_len it awaits its last token; running tables are never None)
            new_ids = append_slots(seq.seq_id, start + 1) if start >= table.num_slots else ()
            if seq.known_to_stages and new_ids is not None:
                if new_ids:  # a known sequence has sent every block but these
                    seq.num_block_ids_sent = len(table.blocks)
                item: tuple[object, ...]
                if start < num_known:  # the stages' history lacks the input token, normally
                    sent = seq.num_tokens_sent
                    news = (tokens[start],) if sent == start else tuple(tokens[sent : start + 1])
                    item = (seq.seq_id, new_ids, start, 1, news, None, True)
                    num_known = start + 1  # hashable once this step is sent
                else:  # run-ahead: the input is the token its previous step samples
                    item = (seq.seq_id, new_ids, start, 1, (), seq.last_sample_step, True)
                seq.num_tokens_sent = start + 1
                cached.append(_new_tuple(CachedSeq, item))
                seq.num_computed = start + 1
                seq.num_inflight += 1
                seq.num_pending += 1
                seq.last_step_id = seq.last_sample_step = step_id
                sampling.append(seq)
                if num_known >= (table.num_cached_blocks + 1) * cache_unit:
                    self.to_cache.append(seq)
            elif self._reserve(seq, start + 1):
                self._emit(seq, 1, True)  # charges the budgets itself
                num_slow += 1
            else:
                continue
            num_decodes += 1
        self.token_budget -= num_decodes - num_slow
        self.seq_budget -= num_decodes - num_slow
        return deferred

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Give running ``seq`` room for ``num_tokens`` slots, preempting the newest running
        sequences while the pool is short. False if ``seq`` itself had to be preempted."""
        table = seq.table
        assert table is not None
        if num_tokens <= table.num_slots:
            return True
        state = self.state
        while state.kv.append_slots(seq.seq_id, num_tokens) is None:
            victim = state.running[-1]  # newest; never one already in this step (see module)
            state.preempt(victim)
            self.preempted = True
            if victim is seq:
                return False
        return True

    def _schedule_chunks(self, deferred: list[Sequence]) -> None:
        """Phase 2: prefill chunks of running sequences, shrunk to the free blocks."""
        kv = self.state.kv
        for seq in deferred:
            if not self.seq_budget or not self.token_budget:
                return
            table = seq.table
            if seq.state is not SeqState.RUNNING or table is None:
                continue
            room = table.num_slots - seq.num_computed + kv.num_available_blocks * self.block_size
            num_new = min(seq.compute_limit - seq.num_computed, self.token_budget, room)
            if num_new <= 0:
                continue
            appended = kv.append_slots(seq.seq_id, seq.num_computed + num_new)
            assert appended is not None, "room was computed from the free blocks"
            self._emit(seq, num_new, seq.num_computed + num_new == seq.num_total)

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
        state = self.state
        kv = state.kv
        num_known = len(seq.token_ids)
        # At most num_known - 1 tokens may hit: the last one must run to give logits.
        hit = kv.find_cached_prefix(seq.hash_chain, seq.token_ids, num_known - 1)
        num_computed = hit.num_tokens
        fork_now = bool(seq.extra_choices) and num_computed == num_known - 1
        limit = num_known if fork_now else seq.compute_limit
        num_new = min(limit - num_computed, self.token_budget)
        table = kv.allocate(seq.seq_id, num_computed + num_new, seq.hash_chain, hit)
        if table is None:
            return False
        state.waiting.pop(seq)
        seq.table = table
        seq.num_computed = num_computed
        state.start_running(seq)
        if fork_now:
            forked = state.fork_choices(seq)  # full blocks only: shares, never copies
            assert forked
        self._emit(seq, num_new, num_computed + num_new == seq.num_total)
        return True

    def _emit(self, seq: Sequence, num_new: int, sample: bool) -> None:
        """Add ``seq`` to the plan: positions ``[num_computed, num_computed + num_new)``."""
        table = seq.table
        assert table is not None
        start = seq.num_computed
        num_known = len(seq.token_ids)
        if seq.known_to_stages:
            sent = seq.num_block_ids_sent
            new_ids = table.block_ids_from(sent) if len(table.blocks) > sent else ()
            end, sent = start + num_new, seq.num_tokens_sent
            if start < num_known:  # send the inputs the stages' history lacks (maybe none)
                news = tuple(seq.token_ids[sent:end])
                self.cached_seqs.append(CachedSeq(seq.seq_id, new_ids, start, num_new, news,
                                                  None, sample))
            else:  # run-ahead: the input is the token its previous step samples
                self.cached_seqs.append(CachedSeq(seq.seq_id, new_ids, start, num_new, (),
                                                  seq.last_sample_step, sample))
            seq.num_tokens_sent = max(sent, end)
        else:
            self.new_seqs.append(NewSeq(seq.seq_id, tuple(seq.token_ids), seq.sampling,
                                        table.block_ids, start, num_new, sample))
            seq.known_to_stages = True
            seq.num_tokens_sent = num_known
        seq.num_block_ids_sent = len(table.blocks)
        seq.num_computed = start + num_new
        seq.num_inflight += 1
        seq.last_step_id = self.step_id
        if sample:
            seq.num_pending += 1
            seq.last_sample_step = self.step_id
            self.sampling.append(seq)
        else:
            self.silent.append(seq)
        self.token_budget -= num_new
        self.seq_budget -= 1
        if self.caching and min(seq.num_computed, num_known) >= (
            table.num_cached_blocks + 1
        ) * self.block_size:
            self.to_cache.append(seq)

    def _finish(self) -> StepPlan | None:
        state = self.state
        # Registered only now, so no sequence of this step hits blocks this step computes.
        for seq in self.to_cache:
            state.kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed)
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
        state.inflight.push(InflightStep(self.step_id, self.sampling, self.silent))
        state.next_step_id += 1
        return plan
