"""The scheduler's bookkeeping and the primitives that keep it consistent."""

from __future__ import annotations

from bisect import insort

from kvcache import BlockAllocation, BlockCopy, KVCacheConfig, KVCacheManager
from router.scheduler.config import SchedulerConfig
from router.scheduler.inflight import InflightSteps
from router.scheduler.sequence import NEVER, FinishReason, NoticeKind, SeqState, Sequence
from router.scheduler.waiting_queue import WaitingQueue


class SchedulerState:
    """Every live sequence, where it is, and what the stages must be told next.

    Invariants (``router.scheduler.integrity`` checks them all):
      * a live sequence is in exactly one of: the waiting queue, ``running`` (sorted by
        ``order_key``), its parent's ``extra_choices``;
      * exactly the running sequences hold blocks in ``kv``, and each one's block counts agree
        with the manager's answers;
      * ``notices`` names only sequences the stages knew, once each.
    """

    def __init__(self, config: SchedulerConfig, kv_config: KVCacheConfig) -> None:
        """Raises ValueError if one sequence of ``max_model_len`` tokens cannot fit the pool."""
        need = -(-config.max_model_len // kv_config.block_size)
        if need > kv_config.num_blocks:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {need} blocks of "
                f"{kv_config.block_size} tokens; the pool has {kv_config.num_blocks}")
        self.config = config
        self.kv = KVCacheManager(kv_config)
        self.seqs: dict[int, Sequence] = {}
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.inflight = InflightSteps()
        self.notices: dict[int, NoticeKind] = {}
        self.block_copies: list[BlockCopy] = []
        self.fork_ready: list[Sequence] = []  # parents whose prompt reached the fork point
        self.next_step_id = 0
        self.num_preemptions = 0

    def start_running(self, seq: Sequence, allocation: BlockAllocation) -> None:
        """Move ``seq`` into the running list at its place, holding the blocks ``allocation``
        (from ``allocate`` or ``fork``) gave it."""
        seq.num_slots = allocation.num_slots
        seq.next_cache_at = self.kv.cache_threshold(seq.seq_id)
        seq.state = SeqState.RUNNING
        insort(self.running, seq, key=_order_key)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of running ``seq`` whose tokens are known and scheduled.

        Call when ``min(seq.num_computed, len(seq.token_ids)) >= seq.next_cache_at``, and only
        once the step scheduling them is sent (see ``KVCacheManager.cache_full_blocks``).
        Mutates: the prefix cache, ``seq.hash_chain`` and ``seq.next_cache_at``.
        """
        kv = self.kv
        kv.cache_full_blocks(seq.seq_id, seq.hash_chain, seq.token_ids, seq.num_computed)
        seq.next_cache_at = kv.cache_threshold(seq.seq_id)

    def preempt(self, seq: Sequence) -> None:
        """Take the blocks of running ``seq`` back and queue it again (recompute later).

        Its tokens in outstanding steps are discarded; the stages are told in the next plan and
        it is not sent as new before the plan after that. Pending choices stay with it.
        """
        if self.running and self.running[-1] is seq:
            self.running.pop()
        else:
            self.running.remove(seq)
        self._drop_blocks(seq)
        if seq.known_to_stages:
            self.notices[seq.seq_id] = NoticeKind.PREEMPTED
            seq.known_to_stages = False
            seq.free_notice_pending = True
        seq.state = SeqState.WAITING
        self.waiting.push(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def release(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` in whatever state it is: free its blocks once, tell the stages once.

        Extra choices still waiting for this sequence's prompt end with it.
        """
        if seq.state is SeqState.WAITING:
            self.waiting.discard(seq)
        elif seq.state is SeqState.RUNNING:
            self.running.remove(seq)
            self._drop_blocks(seq)
        elif seq.state is SeqState.CHOICE_PENDING and seq.parent is not None:
            seq.parent.extra_choices.remove(seq)
            seq.parent = None
        kind = NoticeKind.ABORTED if reason is FinishReason.ABORT else NoticeKind.FINISHED
        if seq.known_to_stages or seq.seq_id in self.notices:
            self.notices[seq.seq_id] = kind  # a pending preemption notice becomes this one
        seq.known_to_stages = False
        seq.free_notice_pending = False
        seq.state = SeqState.FINISHED
        del self.seqs[seq.seq_id]
        for choice in seq.extra_choices:
            choice.parent = None
            self.release(choice, reason)
        seq.extra_choices = []

    def fork_choices(self, parent: Sequence) -> bool:
        """Fork every pending choice off ``parent``, which computed all but its last token.

        Each choice shares the parent's full blocks and gets a copy of a partly filled last
        block (queued in ``block_copies`` for the next plan); it then runs as a decode of the
        last prompt token, sampling its own first token.

        Returns:
            False if the pool ran out of blocks; the choices not forked yet stay pending.
        """
        num_tokens = parent.num_computed
        while parent.extra_choices:
            choice = parent.extra_choices[0]
            forked = self.kv.fork(parent.seq_id, choice.seq_id, num_tokens)
            if forked is None:
                return False
            if forked.block_copy is not None:
                self.block_copies.append(forked.block_copy)
            parent.extra_choices.pop(0)
            choice.parent = None
            choice.hash_chain = parent.hash_chain.copy()
            choice.num_computed = num_tokens
            self.start_running(choice, forked)
        return True

    def take_notices(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Empty the notices into (finished, aborted, preempted) ids, for the plan being built.

        Mutates: clears ``notices``; the sequences named may be sent as new from the next plan.
        """
        if not self.notices:
            return (), (), ()
        finished: list[int] = []
        aborted: list[int] = []
        preempted: list[int] = []
        by_kind = {NoticeKind.FINISHED: finished, NoticeKind.ABORTED: aborted,
                   NoticeKind.PREEMPTED: preempted}
        for seq_id, kind in self.notices.items():
            by_kind[kind].append(seq_id)
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.free_notice_pending = False
        self.notices.clear()
        return tuple(finished), tuple(aborted), tuple(preempted)

    def _drop_blocks(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        seq.num_slots = 0
        seq.next_cache_at = NEVER
        if seq.num_inflight:
            self.inflight.mark_stale(seq.seq_id)
        seq.num_inflight = 0
        seq.num_pending = 0
        seq.num_computed = 0
        seq.num_block_ids_sent = 0
        seq.num_tokens_sent = 0


def _order_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.order_key
