"""Steady decode continued in columns: a stage's lanes.

In steady decode a micro-batch's step is its step of P steps before, one token on: the same
sequences in the same order, each one position further, its input the token sampled there
(run-ahead) or, when the router had it already, that token appended. A lane is what the
stage keeps of such a step once it applied it, under the batch's sequence ids as sent: the
sequences' states and block tables, the positions its continuation computes, and how many
more positions every table holds. A plan whose batch is a `SteadyBatch` continuing a lane
by exactly one token, with nothing else in it (no new sequence, free or block copy), is
checked and applied against the lane's columns: comparisons of bytes and passes in C; only
a sequence that opens a block is touched on its own. Any other plan goes through
`plan_check` and `HeldSeqs.apply`, and leaves a lane when its batch is one
(`Lanes.note`).

A continuation is refused here (and then checked in full, so it is refused there if it is
wrong) unless it meets what `plan_check` asks of the same batch:
- its sequence ids, as sent, are the lane's, and its positions are the lane's next ones;
- every one of those sequences is still held, as the same state (none freed, or freed and
  sent again, since);
- every block table, with the blocks the plan appends (ids inside the pool), holds one
  more position (tables only grow: the room counted when the lane was made is a lower
  bound);
- a run-ahead step is the lane's (earlier than the plan); on the last stage, the step that
  sampled every one of them last.
The first stage's known tokens need no look: each sequence's history grew by the lane's
step's input, so it holds the input of the continuation's position too. The batch's size
was checked against the limits when the lane's step was.

Lanes serve the stages that apply a plan in one place: TP size 1. In a one-stage pipeline
(`on_device`), which overlaps its steps (`StageLeader.step_overlapped`), a run-ahead
continuation applied before its lane's step is resolved gives each history a placeholder
that `HeldSeqs.record_sampled` fills, and its inputs are the ids that step left on the
device (`StepInputs.ahead`), as `HeldSeqs.apply` does.
"""

from __future__ import annotations

import sys
from array import array
from collections import deque
from itertools import compress, islice, repeat
from operator import add, attrgetter, getitem, is_, itemgetter, mul, sub

from stage_worker.held_seqs import HeldSeq, HeldSeqs, LaneAhead, StepInputs
from stage_worker.plan import StagePlan, SteadyBatch
from stage_worker.step_input import SeqChunk

MAX_LANES = 16  # lanes kept (the newest): > the micro-batches of any pipeline
_new_tuple = tuple.__new__  # a SeqChunk from a tuple, without the NamedTuple's Python __new__
_TOKENS, _OUTPUTS = attrgetter("token_ids"), attrgetter("output_ids")
_LAST_SAMPLED, _LAST = attrgetter("last_sample_step"), itemgetter(-1)


def _wire(values: array[int]) -> bytes:
    """`values` as the plan's columns carry them (little-endian)."""
    if sys.byteorder != "little":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


class Lane:
    """One applied steady step of a micro-batch, as columns (batch order).

    step_id: the step; a run-ahead continuation names it as every sequence's input step.
    positions: int32, the position each sequence computes next (its continuation's
        num_computed); next_key: the same as the plan's column carries it.
    room: the fewest positions any block table holds from its next position on.
    """

    __slots__ = ("next_key", "positions", "room", "seq_ids", "seq_key", "states", "step_id",
                 "tables", "tokens")

    def __init__(self, step_id: int, seq_ids: tuple[int, ...], states: list[HeldSeq],
                 tables: list[list[int]], positions: array[int], room: int) -> None:
        self.step_id = step_id
        self.seq_ids = seq_ids
        self.seq_key = _wire(array("q", seq_ids))
        self.states = states
        self.tables = tables  # the states' own lists (they grow in place)
        self.tokens = list(map(_TOKENS, states))  # the same: the histories
        self.positions = positions
        self.next_key = _wire(positions)
        self.room = room

    def advance(self, step_id: int) -> None:
        """The lane is now `step_id`'s, which computed its positions."""
        self.step_id = step_id
        self.positions = array("i", map(add, self.positions, repeat(1)))
        self.next_key = _wire(self.positions)
        self.room -= 1


class Lanes:
    """The lanes of one stage's held sequences, by their sequence ids as sent (see the
    module). `enabled` False: `match` finds none and `note` keeps none. `on_device`: a
    one-stage pipeline's, whose run-ahead inputs are on the device."""

    def __init__(self, held: HeldSeqs, block_size: int, num_blocks: int, knows_samples: bool,
                 enabled: bool, on_device: bool = False) -> None:
        self.held = held
        self.block_size = block_size
        self.num_blocks = num_blocks  # block ids are in [0, num_blocks)
        self.knows_samples = knows_samples  # the last stage: it sampled every input
        self.enabled = enabled
        self.on_device = on_device
        self._lanes: dict[bytes, Lane] = {}

    def __len__(self) -> int:
        return len(self._lanes)

    def match(self, plan: StagePlan) -> Lane | None:
        """The lane `plan` continues (see the module), or None: then check it in full."""
        batch = plan.cached_seqs
        if (not self.enabled or not isinstance(batch, SteadyBatch) or plan.new_seqs
                or plan.free_seq_ids or plan.block_copies
                or (self.held.keep_tokens and batch.from_step is None
                    and batch.appended is None)):  # a stage that keeps tokens needs inputs
            return None
        lane = self._lanes.get(batch.seq_key)
        if (lane is None or plan.step_id <= lane.step_id
                or batch.computed_key != lane.next_key
                or batch.from_step not in (None, lane.step_id)):
            return None
        counts, ids = batch.block_counts, batch.block_ids
        if counts is None:
            if lane.room < 1:
                return None
        elif ((ids and (min(ids) < 0 or max(ids) >= self.num_blocks))
              or self._room(lane, counts) < 1):
            return None
        states = lane.states
        if not all(map(is_, map(self.held.seqs.get, lane.seq_ids), states)):
            return None
        if (self.knows_samples and batch.from_step is not None
                and list(map(_LAST_SAMPLED, states)).count(lane.step_id) != len(states)):
            return None
        return lane

    def apply(self, lane: Lane, plan: StagePlan, deferred: bool) -> StepInputs:
        """Apply `plan`, which `match` found to continue `lane`, as `HeldSeqs.apply` would:
        blocks join their tables; each history gets its input (appended in the plan; or
        run-ahead: on the first stage, `deferred`, a placeholder that the step's late fill
        writes, named by the inputs' `lane_ahead`; on the last the token it sampled at the
        lane's step); the step's chunks (and, where inputs are built, its inputs and
        run-ahead rows) come back."""
        batch = plan.cached_seqs
        assert isinstance(batch, SteadyBatch), "match() continues steady batches only"
        held, n, k = self.held, len(lane.states), lane.step_id
        counts = batch.block_counts
        if counts is not None:  # the few sequences that open a block this step
            ids, tables, refs = iter(batch.block_ids), lane.tables, held.block_refs
            for i in compress(range(n), counts):
                new = list(islice(ids, counts[i]))
                tables[i] += new
                for block in new:  # not Counter.update: its Mapping check is Python-level
                    refs[block] = refs.get(block, 0) + 1
            lane.room = self._room(lane)
        inputs = StepInputs(list(map(_new_tuple, repeat(SeqChunk), zip(
            lane.seq_ids, lane.positions, repeat(1, n), lane.tables, repeat(True, n),
            repeat(0, n), strict=True))), [], [])
        if held.keep_tokens:
            ahead = batch.appended is None  # else each input came in the plan
            if batch.appended is not None:
                tokens = list(batch.appended)
            elif deferred:
                tokens = [0] * n
            else:
                tokens = list(map(_LAST, map(_OUTPUTS, lane.states)))
            deque(map(list.append, lane.tokens, tokens), maxlen=0)
            if held.builds_inputs and ahead and deferred:
                inputs.input_ids = tokens  # each input: the placeholder just appended
                if self.on_device:  # one stage: the record of the lane's step fills them;
                    held.defer(lane.seq_ids, lane.positions)  # every row left on the device
                    inputs.ahead = list(zip(range(n), lane.seq_ids, repeat(k, n), strict=True))
                else:  # the late fill writes them
                    inputs.lane_ahead = LaneAhead(lane.seq_ids, k, lane.tokens)
            elif held.builds_inputs:
                inputs.input_ids = list(map(getitem, lane.tokens, lane.positions))
                if ahead:
                    inputs.ahead = list(zip(range(n), lane.seq_ids, repeat(k, n), strict=True))
        lane.advance(plan.step_id)
        return inputs

    def note(self, plan: StagePlan, inputs: StepInputs) -> None:
        """After `HeldSeqs.apply` of `plan`: keep a lane of its batch when every sequence of
        it (none new) computed one sampled position, scoring no prompt."""
        chunks = inputs.chunks
        if not self.enabled or plan.new_seqs or not chunks:
            return
        n = len(chunks)
        seq_ids, starts, num_new, tables, sample, rows = zip(*chunks, strict=True)
        if num_new.count(1) != n or sample.count(True) != n or rows.count(0) != n:
            return
        lane = Lane(plan.step_id, seq_ids, list(map(self.held.seqs.__getitem__, seq_ids)),
                    list(tables), array("i", map(add, starts, repeat(1, n))), 0)
        lane.room = self._room(lane)
        self._keep(lane)

    def _room(self, lane: Lane, adding: array[int] | None = None) -> int:
        """The fewest positions any of `lane`'s tables holds from its next position on (with
        `adding[i]` more blocks in table i)."""
        n, size = len(lane.tables), self.block_size
        blocks = map(len, lane.tables) if adding is None else map(add, map(len, lane.tables),
                                                                  adding)
        return min(map(sub, map(mul, blocks, repeat(size, n)), lane.positions))

    def _keep(self, lane: Lane) -> None:
        lanes = self._lanes
        lanes.pop(lane.seq_key, None)  # the newest last: the oldest is dropped first
        lanes[lane.seq_key] = lane
        if len(lanes) > MAX_LANES:
            del lanes[next(iter(lanes))]

    def clear(self) -> None:
        self._lanes.clear()
