"""Property tests: random add / step / finish / abort / preempt / resume / fork sequences.

A model keeps, for every block, the tokens whose KV a stage would have written into it, and
for every sequence the block ids the allocation records reported. After every rule:
``check_integrity()`` passes, the manager's queries agree with the records, every live table
holds exactly its sequence's tokens, and every prefix hit handed out held the right tokens. At
the end, once everything is freed, no block is held.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from kvcache import BlockAllocation, BlockHashChain, KVCacheConfig, KVCacheManager

B = 2
NUM_BLOCKS = 12
TOKENS = st.integers(min_value=0, max_value=2)  # a tiny vocabulary makes prefixes collide


class KVCacheMachine(RuleBasedStateMachine):
    live = Bundle("live")
    preempted = Bundle("preempted")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(KVCacheConfig(num_blocks=NUM_BLOCKS, block_size=B))
        self.tokens: dict[int, list[int]] = {}  # live sequences
        self.chains: dict[int, BlockHashChain] = {}  # their hash chains (the caller's)
        self.block_ids: dict[int, list[int]] = {}  # their tables, as the records reported
        self.saved: dict[int, list[int]] = {}  # preempted sequences, waiting to resume
        self.content: dict[int, list[int | None]] = {i: [None] * B for i in range(NUM_BLOCKS)}
        self.next_id = 0

    def _write(self, seq_id: int, start: int) -> None:
        """What a stage does: write the KV of positions [start, len) through the table."""
        tokens = self.tokens[seq_id]
        block_ids = self.kv.block_ids(seq_id)
        for pos in range(start, len(tokens)):
            self.content[block_ids[pos // B]][pos % B] = tokens[pos]

    def _record(self, seq_id: int, allocation: BlockAllocation, replace: bool) -> None:
        """Check an allocation record against the model and keep its ids."""
        ids = [] if replace else self.block_ids[seq_id]
        ids += allocation.new_block_ids
        self.block_ids[seq_id] = ids
        assert allocation.num_slots == len(ids) * B

    def _admit(self, tokens: list[int]) -> int | None:
        seq_id = self.next_id
        self.next_id += 1
        chain = BlockHashChain(B)
        hit = self.kv.find_cached_prefix(chain, tokens, len(tokens) - 1)
        for index, block_id in enumerate(hit.block_ids):
            assert self.content[block_id] == tokens[index * B : (index + 1) * B]
        allocation = self.kv.allocate(seq_id, len(tokens), hit)
        if allocation is None:
            return None
        assert allocation.new_block_ids[: len(hit.block_ids)] == hit.block_ids
        self._record(seq_id, allocation, replace=True)
        self.tokens[seq_id] = list(tokens)
        self.chains[seq_id] = chain
        self._write(seq_id, hit.num_tokens)
        self.kv.cache_full_blocks(seq_id, chain, tokens, len(tokens))
        return seq_id

    @rule(target=live, prompt=st.lists(TOKENS, min_size=1, max_size=9))
    def add(self, prompt: list[int]) -> object:
        seq_id = self._admit(prompt)
        return multiple() if seq_id is None else seq_id

    @rule(seq_id=live, token=TOKENS)
    def step(self, seq_id: int, token: int) -> None:
        if seq_id not in self.tokens:
            return
        tokens = self.tokens[seq_id]
        allocation = self.kv.append_slots(seq_id, len(tokens) + 1)
        if allocation is None:
            return
        self._record(seq_id, allocation, replace=False)
        tokens.append(token)
        self._write(seq_id, len(tokens) - 1)
        self.kv.cache_full_blocks(seq_id, self.chains[seq_id], tokens, len(tokens))

    @rule(seq_id=consumes(live))
    def finish_or_abort(self, seq_id: int) -> None:
        if seq_id in self.tokens:
            self.kv.free(seq_id)
            del self.tokens[seq_id], self.chains[seq_id], self.block_ids[seq_id]

    @rule(target=preempted, seq_id=consumes(live))
    def preempt(self, seq_id: int) -> object:
        if seq_id not in self.tokens:
            return multiple()
        self.kv.free(seq_id)
        self.saved[seq_id] = self.tokens.pop(seq_id)
        del self.chains[seq_id], self.block_ids[seq_id]
        return seq_id

    @rule(target=live, old_id=consumes(preempted))
    def resume(self, old_id: int) -> object:
        tokens = self.saved.pop(old_id)
        seq_id = self._admit(tokens)
        return multiple() if seq_id is None else seq_id

    @rule(target=live, parent=live)
    def fork(self, parent: int) -> object:
        if parent not in self.tokens:
            return multiple()
        child = self.next_id
        self.next_id += 1
        num_tokens = len(self.tokens[parent])
        forked = self.kv.fork(parent, child, num_tokens)
        if forked is None:
            return multiple()
        self._record(child, forked, replace=True)
        shared = self.block_ids[parent][: num_tokens // B]
        assert forked.new_block_ids[: len(shared)] == tuple(shared)
        copy = forked.block_copy
        assert (copy is None) is (num_tokens % B == 0)
        if copy is not None:
            assert copy.dst_block_id == forked.new_block_ids[-1]
            self.content[copy.dst_block_id] = list(self.content[copy.src_block_id])
        self.tokens[child] = list(self.tokens[parent])
        self.chains[child] = self.chains[parent].copy()
        return child

    @invariant()
    def consistent(self) -> None:
        self.kv.check_integrity()
        assert self.kv.num_seqs == len(self.tokens)
        for seq_id, tokens in self.tokens.items():
            block_ids = self.kv.block_ids(seq_id)
            assert block_ids == tuple(self.block_ids[seq_id])
            assert self.kv.num_slots(seq_id) == len(block_ids) * B >= len(tokens)
            written = [self.content[block_ids[p // B]][p % B] for p in range(len(tokens))]
            assert written == tokens, f"sequence {seq_id} reads another's KV"

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.kv.free(seq_id)
        self.kv.check_integrity()
        usage = self.kv.usage()
        assert usage.num_used_blocks == 0
        assert usage.num_free_blocks + usage.num_cached_free_blocks == NUM_BLOCKS


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                            deadline=None)
TestKVCacheProperties = KVCacheMachine.TestCase
