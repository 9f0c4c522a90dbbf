"""Per-sequence state a stage keeps between plans, keyed by sequence id.

Every TP rank of a stage applies the same plans, so they hold the same state.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from foundation.sampling_params import SamplingParams
from stage_worker.plan import StagePlan
from stage_worker.step_input import SeqChunk


class PlanError(ValueError):
    """A plan that contradicts the stage's state (unknown or duplicate sequence, short
    block table). The stage fails the step loudly rather than guessing."""


@dataclass
class SeqState:
    block_table: list[int]
    token_ids: list[int]  # known tokens (first and last stage); empty elsewhere
    prompt_len: int
    num_outputs: int  # tokens generated so far: the index of the next sampled token
    sampling: SamplingParams | None
    output_ids: list[int] = field(default_factory=list)  # sampled here (last stage)


class StageState:
    """Applies plans: frees, new sequences and diffs, in that order.

    Mutates its table of sequences; `block_refs` counts each block's users so KV usage is
    known in O(1).
    """

    def __init__(self) -> None:
        self.seqs: dict[int, SeqState] = {}
        self.block_refs: Counter[int] = Counter()

    @property
    def kv_blocks_used(self) -> int:
        return len(self.block_refs)

    def apply(self, plan: StagePlan) -> tuple[list[SeqChunk], list[int]]:
        """Update state for `plan`; returns the step's chunks (batch order) and, where the
        stage knows tokens, the input ids of the step (first stage)."""
        for seq_id in plan.free_seq_ids:
            self.free(seq_id)
        chunks: list[SeqChunk] = []
        input_ids: list[int] = []
        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise PlanError(f"step {plan.step_id}: sequence {new.seq_id} sent as new but "
                                "already held")
            outputs = max(0, len(new.token_ids) - new.prompt_len)
            state = SeqState(list(new.block_ids), list(new.token_ids), new.prompt_len,
                             outputs, new.sampling, list(new.token_ids[new.prompt_len:]))
            self.seqs[new.seq_id] = state
            self.block_refs.update(new.block_ids)
            chunks.append(self._chunk(plan.step_id, new.seq_id, state, new.num_computed,
                                      new.num_new, new.sample))
            input_ids += state.token_ids[new.num_computed:new.num_computed + new.num_new]
        for cached in plan.cached_seqs:
            if cached.seq_id not in self.seqs:
                raise PlanError(f"step {plan.step_id}: sequence {cached.seq_id} is not held "
                                "by this stage")
            state = self.seqs[cached.seq_id]
            state.block_table += cached.new_block_ids
            self.block_refs.update(cached.new_block_ids)
            state.token_ids += cached.append_token_ids
            chunks.append(self._chunk(plan.step_id, cached.seq_id, state, cached.num_computed,
                                      cached.num_new, cached.sample))
            input_ids += state.token_ids[cached.num_computed:cached.num_computed + cached.num_new]
        return chunks, input_ids

    def record_sampled(self, seq_id: int, token_id: int) -> None:
        """The last stage sampled `token_id` for `seq_id` (for penalties and seeds)."""
        state = self.seqs[seq_id]
        state.output_ids.append(token_id)
        state.num_outputs += 1

    def free(self, seq_id: int) -> None:
        """Forget a sequence (unknown ids are ignored: frees are idempotent)."""
        state = self.seqs.pop(seq_id, None)
        if state is None:
            return
        self.block_refs.subtract(state.block_table)
        for block in set(state.block_table):
            if self.block_refs[block] <= 0:
                del self.block_refs[block]

    def clear(self) -> int:
        dropped = len(self.seqs)
        self.seqs.clear()
        self.block_refs.clear()
        return dropped

    @staticmethod
    def _chunk(step_id: int, seq_id: int, state: SeqState, num_computed: int, num_new: int,
               sample: bool) -> SeqChunk:
        if num_new < 1:
            raise PlanError(f"step {step_id}: sequence {seq_id} computes {num_new} tokens")
        return SeqChunk(seq_id, num_computed, num_new, tuple(state.block_table), sample)
