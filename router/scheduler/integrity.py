"""``check_scheduler_integrity``: every invariant of ``SchedulerState``, for tests."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from kvcache import IntegrityError
from router.scheduler.sequence import NEVER, SeqState, Sequence
from router.scheduler.state import SchedulerState


def check_scheduler_integrity(state: SchedulerState) -> None:
    """Verify the KV pool, then that sequences, queues, the manager's block tables and the
    outstanding steps agree: every block count the scheduler keeps is checked against the
    ``KVCacheManager``'s answer for that sequence.

    O(sequences + blocks + outstanding entries). Raises IntegrityError on the first problem.
    """
    kv = state.kv
    kv.check_integrity()
    _check_membership(state)
    _require(kv.num_seqs == len(state.running),
             f"{kv.num_seqs} sequences hold blocks, {len(state.running)} run")
    for seq in state.running:
        _check_running(state, seq)
    for seq in state.waiting.live():
        _require(seq.num_slots == 0 and seq.next_cache_at == NEVER
                 and not kv.has_table(seq.seq_id), f"waiting {seq} holds blocks")
        _require(seq.num_computed == seq.num_pending == seq.num_inflight == 0,
                 f"waiting {seq} has computed or in-flight tokens")
    _check_inflight(state)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)


def _check_membership(state: SchedulerState) -> None:
    running = state.running
    waiting = state.waiting.live()
    _require(all(a.order_key < b.order_key for a, b in pairwise(running)),
             "running list out of order")
    _require(all(s.state is SeqState.RUNNING for s in running), "non-running seq in running")
    _require(state.waiting.num_seqs == len(waiting), "waiting count drifted")
    _require(state.waiting.num_tokens == sum(len(s.token_ids) for s in waiting),
             "waiting token count drifted")
    pending = [c for s in state.seqs.values() for c in s.extra_choices]
    _require(all(c.state is SeqState.CHOICE_PENDING and c.parent is not None for c in pending),
             "a pending choice is not pending")
    members = Counter(s.seq_id for s in (*running, *waiting, *pending))
    _require(set(members) == set(state.seqs) and all(n == 1 for n in members.values()),
             f"live sequences {sorted(state.seqs)} vs queued {sorted(members.elements())}")
    _require(all(state.seqs[i] is s for i, s in ((s.seq_id, s) for s in running)),
             "running seq not registered")
    _require(len(state.inflight) <= state.config.max_outstanding_steps, "too many steps out")


def _check_running(state: SchedulerState, seq: Sequence) -> None:
    kv = state.kv
    _require(kv.has_table(seq.seq_id), f"running {seq} holds no blocks")
    num_slots = kv.num_slots(seq.seq_id)
    _require(seq.num_slots == num_slots, f"{seq}: {seq.num_slots} slots, the KV manager "
             f"says {num_slots}")
    threshold = kv.cache_threshold(seq.seq_id)
    _require(seq.next_cache_at == threshold,
             f"{seq}: next_cache_at {seq.next_cache_at}, the KV manager says {threshold}")
    _require(seq.num_computed <= seq.num_slots, f"{seq} computed beyond its slots")
    _require(seq.num_computed <= seq.num_total, f"{seq} computed beyond its tokens")
    _require(seq.num_pending <= seq.num_inflight, f"{seq} pending more than in flight")
    num_blocks = len(kv.block_ids(seq.seq_id))
    _require(seq.num_block_ids_sent == num_blocks if seq.known_to_stages
             else seq.num_block_ids_sent == 0, f"{seq}: blocks sent to stages drifted")
    _require(seq.num_computed <= seq.num_tokens_sent <= seq.num_total if seq.known_to_stages
             else seq.num_tokens_sent == 0, f"{seq}: tokens sent to stages drifted")
    _require(seq.num_total <= state.config.max_model_len, f"{seq} past max_model_len")
    _require(not seq.free_notice_pending, f"running {seq} still awaits its free notice")


def _check_inflight(state: SchedulerState) -> None:
    """Counts per sequence match the records; P consecutive steps never share a sequence."""
    config = state.config
    inflight: Counter[int] = Counter()
    sampling: Counter[int] = Counter()
    steps_of: dict[int, list[int]] = {}
    for step in state.inflight:
        for seq in (*step.sampling, *step.silent):
            # Stale entries still run on the stages: they count for disjointness.
            steps_of.setdefault(seq.seq_id, []).append(step.step_id)
            if seq.seq_id not in step.stale:
                inflight[seq.seq_id] += 1
        sampling.update(s.seq_id for s in step.sampling if s.seq_id not in step.stale)
    for seq in state.seqs.values():
        _require(seq.num_inflight == inflight[seq.seq_id], f"{seq}: in-flight count drifted")
        _require(seq.num_pending == sampling[seq.seq_id], f"{seq}: pending count drifted")
    limit = config.max_steps_per_seq
    for seq_id, step_ids in steps_of.items():
        _require(len(step_ids) <= limit, f"sequence {seq_id} in steps {step_ids}")
        gaps = [b - a for a, b in pairwise(step_ids)]
        _require(all(g >= config.max_inflight_steps for g in gaps),
                 f"sequence {seq_id} in steps {step_ids}, closer than P")
