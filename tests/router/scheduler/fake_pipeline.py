"""A fake pipeline for scheduler tests: applies plans like a stage and "samples" tokens.

The fake model is deterministic in the token history: the KV slot of position ``p`` holds
``state_p = mix(state_{p-1}, token_p)`` and the token sampled after position ``p`` is
``mix(state_p, seed) % vocab`` (``seed`` is the sequence's opaque sampling object). Computing a
position reads the previous slot *from the shared pool through the block table*, so any wrong
block id, a lost copy, a bad prefix hit or a block reused too early changes the tokens, and the
stage also asserts each slot it reads. ``reference_tokens`` generates the same tokens with no
blocks at all, which is what every sequence must produce, preempted or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.scheduler import StepPlan

SEED_STATE = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def mix(a: int, b: int) -> int:
    """A cheap 64-bit mixing function (splitmix-like)."""
    x = (a ^ (b * 0xBF58476D1CE4E5B9)) & MASK
    x = ((x ^ (x >> 31)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 29)


def sample_token(state: int, seed: int, vocab: int) -> int:
    return mix(state, seed + 1) % vocab


def reference_tokens(prompt: list[int], seed: int, vocab: int, max_tokens: int,
                     eos: int | None) -> list[int]:
    """Tokens the fake model generates for ``prompt``, stopping at EOS (kept) or max_tokens."""
    state = SEED_STATE
    for token in prompt:
        state = mix(state, token)
    out: list[int] = []
    while len(out) < max_tokens:
        token = sample_token(state, seed, vocab)
        out.append(token)
        if token == eos:
            break
        state = mix(state, token)
    return out


@dataclass
class _StageSeq:
    seed: int
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    states: list[int] = field(default_factory=list)  # expected state_p, from tokens alone

    def expected_state(self, pos: int) -> int:
        while len(self.states) <= pos:
            prev = self.states[-1] if self.states else SEED_STATE
            self.states.append(mix(prev, self.tokens[len(self.states)]))
        return self.states[pos]


class FakePipeline:
    """Applies plans in step order over one shared slot pool, as every stage would."""

    def __init__(self, num_blocks: int, block_size: int, vocab: int) -> None:
        self.block_size = block_size
        self.vocab = vocab
        self.pool: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        # Step that wrote each slot: context written by *another* sequence must come from an
        # earlier step (a kernel may compute a step's attention before its KV lands).
        self.written_at: list[list[int]] = [[-1] * block_size for _ in range(num_blocks)]
        self.seqs: dict[int, _StageSeq] = {}
        self.sampled: dict[tuple[int, int], int] = {}  # (step, seq) -> token, for run-ahead
        self.next_step = 0
        self.tokens_computed = 0
        self.lenient_drops = False

    def restart(self, next_step: int) -> None:
        """A stage restarted: its KV and per-sequence state are gone; steps resume here.

        The next plan names every sequence the router had sent, some in plans that were lost
        with the stage, so it may drop sequences this stage never had.
        """
        self.lenient_drops = True
        self.pool = [[None] * self.block_size for _ in self.pool]
        self.written_at = [[-1] * self.block_size for _ in self.pool]
        self.seqs.clear()
        self.next_step = next_step

    def _slot(self, seq: _StageSeq, pos: int) -> tuple[int, int]:
        return seq.block_ids[pos // self.block_size], pos % self.block_size

    def _check_slots(self, seq_id: int, seq: _StageSeq, upto: int) -> None:
        for pos in range(upto):
            block, off = self._slot(seq, pos)
            assert self.pool[block][off] == seq.expected_state(pos), (
                f"seq {seq_id}: slot {pos} (block {block}) holds another sequence's KV")

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Run ``plan`` and return the sampled tokens (its result)."""
        assert plan.step_id == self.next_step, f"plan {plan.step_id}, expected {self.next_step}"
        self.next_step += 1
        lenient, self.lenient_drops = self.lenient_drops, False
        for seq_id in plan.freed_seq_ids:
            if lenient and seq_id not in self.seqs:
                continue
            seq = self.seqs.pop(seq_id)  # KeyError: told to drop a sequence it never had
            self._check_slots(seq_id, seq, seq.num_computed)
        for copy in plan.block_copies:
            self.pool[copy.dst_block_id] = list(self.pool[copy.src_block_id])
            self.written_at[copy.dst_block_id] = list(self.written_at[copy.src_block_id])
        work: list[tuple[int, _StageSeq, int, int, bool]] = []
        for new in plan.new_seqs:
            assert new.seq_id not in self.seqs, f"seq {new.seq_id} sent as new twice"
            assert isinstance(new.sampling, int)
            seq = _StageSeq(new.sampling, list(new.token_ids), list(new.block_ids),
                            new.num_computed_tokens)
            self._check_slots(new.seq_id, seq, new.num_computed_tokens)  # prefix hits, forks
            self.seqs[new.seq_id] = seq
            work.append((new.seq_id, seq, new.num_computed_tokens, new.num_new_tokens, new.sample))
        for cached in plan.cached_seqs:
            seq = self.seqs[cached.seq_id]
            assert cached.num_computed_tokens == seq.num_computed, (cached, seq.num_computed)
            seq.block_ids.extend(cached.new_block_ids)
            seq.tokens += cached.new_token_ids  # the history grows; inputs come from it
            if cached.input_from_step is not None:
                assert cached.num_new_tokens == 1 and not cached.new_token_ids
                seq.tokens.append(self.sampled[(cached.input_from_step, cached.seq_id)])
            end = cached.num_computed_tokens + cached.num_new_tokens
            assert len(seq.tokens) >= end, f"seq {cached.seq_id}: inputs up to {end} unknown"
            work.append((cached.seq_id, seq, cached.num_computed_tokens, cached.num_new_tokens,
                         cached.sample))
        return self._compute(plan.step_id, work)

    def _compute(self, step_id: int, work: list[tuple[int, _StageSeq, int, int, bool]]
                 ) -> dict[int, int]:
        result: dict[int, int] = {}
        for seq_id, seq, start, count, sample in work:
            assert count >= 1
            for pos in range(start, start + count):
                if pos == 0:
                    prev = SEED_STATE
                else:
                    block, off = self._slot(seq, pos - 1)
                    stored = self.pool[block][off]
                    assert stored == seq.expected_state(pos - 1), (
                        f"seq {seq_id}: reading slot {pos - 1} (block {block}) found foreign KV")
                    assert pos > start or self.written_at[block][off] < step_id, (
                        f"seq {seq_id}: context slot {pos - 1} is computed in this very step")
                    prev = stored
                block, off = self._slot(seq, pos)  # IndexError: table too short
                self.pool[block][off] = mix(prev, seq.tokens[pos])
                self.written_at[block][off] = step_id
            seq.num_computed = start + count
            self.tokens_computed += count
            if sample:
                block, off = self._slot(seq, start + count - 1)
                state = self.pool[block][off]
                assert state is not None
                token = sample_token(state, seq.seed, self.vocab)
                result[seq_id] = token
                self.sampled[(step_id, seq_id)] = token
        return result
