"""Property tests: random add / step / finish / abort / preempt / resume / fork sequences.

A model keeps, for every block, the tokens whose KV a stage would have written into it. After
every rule: ``check_integrity()`` passes, every live table holds exactly its sequence's tokens,
and every prefix hit handed out held the right tokens. At the end, once everything is freed,
no block is held.
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

from kvcache import BlockHashChain, KVCacheConfig, KVCacheManager

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
        self.saved: dict[int, list[int]] = {}  # preempted sequences, waiting to resume
        self.content: dict[int, list[int | None]] = {i: [None] * B for i in range(NUM_BLOCKS)}
        self.next_id = 0

    def _write(self, seq_id: int, start: int) -> None:
        """What a stage does: write the KV of positions [start, len) through the table."""
        tokens = self.tokens[seq_id]
        table = self.kv.get_table(seq_id)
        for pos in range(start, len(tokens)):
            self.content[table.blocks[pos // B].block_id][pos % B] = tokens[pos]

    def _admit(self, tokens: list[int]) -> int | None:
        seq_id = self.next_id
        self.next_id += 1
        chain = BlockHashChain(B)
        hit = self.kv.find_cached_prefix(chain, tokens, len(tokens) - 1)
        for index, block in enumerate(hit.blocks):
            assert self.content[block.block_id] == tokens[index * B : (index + 1) * B]
        if self.kv.allocate(seq_id, len(tokens), chain, hit) is None:
            return None
        self.tokens[seq_id] = list(tokens)
        self._write(seq_id, hit.num_tokens)
        self.kv.cache_full_blocks(seq_id, tokens, len(tokens))
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
        if self.kv.append_slots(seq_id, len(tokens) + 1) is None:
            return
        tokens.append(token)
        self._write(seq_id, len(tokens) - 1)
        self.kv.cache_full_blocks(seq_id, tokens, len(tokens))

    @rule(seq_id=consumes(live))
    def finish_or_abort(self, seq_id: int) -> None:
        if seq_id in self.tokens:
            self.kv.free(seq_id)
            del self.tokens[seq_id]

    @rule(target=preempted, seq_id=consumes(live))
    def preempt(self, seq_id: int) -> object:
        if seq_id not in self.tokens:
            return multiple()
        self.kv.free(seq_id)
        self.saved[seq_id] = self.tokens.pop(seq_id)
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
        forked = self.kv.fork(parent, child, len(self.tokens[parent]))
        if forked is None:
            return multiple()
        _, copy = forked
        if copy is not None:
            self.content[copy.dst_block_id] = list(self.content[copy.src_block_id])
        self.tokens[child] = list(self.tokens[parent])
        return child

    @invariant()
    def consistent(self) -> None:
        self.kv.check_integrity()
        for seq_id, tokens in self.tokens.items():
            table = self.kv.get_table(seq_id)
            assert table.num_slots >= len(tokens)
            written = [self.content[table.blocks[p // B].block_id][p % B]
                       for p in range(len(tokens))]
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
