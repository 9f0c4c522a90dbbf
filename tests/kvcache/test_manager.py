"""KVCacheManager: block tables, prefix caching, forks and usage, with exact block ids."""

from __future__ import annotations

import pytest

from kvcache import (
    BlockAllocation,
    BlockCopy,
    BlockHashChain,
    IntegrityError,
    KVCacheConfig,
    KVCacheManager,
    StalePrefixHitError,
    hash_block,
)

B = 4  # block size in these tests


def _manager(num_blocks: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=B,
                                        enable_prefix_caching=caching))


def _start(kv: KVCacheManager, seq_id: int, tokens: list[int], num_tokens: int | None = None
           ) -> tuple[int, list[int]]:
    """Admit like the scheduler: look up the prefix, allocate, register what is computed."""
    chain = BlockHashChain(B)
    hit = kv.find_cached_prefix(chain, tokens, len(tokens) - 1)
    allocation = kv.allocate(seq_id, num_tokens or len(tokens), hit)
    assert allocation is not None
    kv.cache_full_blocks(seq_id, chain, tokens, num_tokens or len(tokens))
    kv.check_integrity()
    return hit.num_tokens, list(allocation.new_block_ids)


def test_config_rejects_empty_pools() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheConfig(num_blocks=1, block_size=0)
    assert KVCacheConfig(num_blocks=3, block_size=4).num_slots == 12


def test_allocate_append_and_free_with_exact_ids() -> None:
    kv = _manager(num_blocks=6)
    assert kv.allocate(1, 5) == BlockAllocation(new_block_ids=(0, 1), num_slots=8)
    assert kv.append_slots(1, 8) == BlockAllocation((), 8)  # room already
    assert kv.append_slots(1, 9) == BlockAllocation((2,), 12)
    assert kv.allocate(2, 12) == BlockAllocation((3, 4, 5), 12)
    assert kv.block_ids(2) == (3, 4, 5)
    assert kv.append_slots(1, 13) is None  # pool empty: nothing changed
    assert kv.block_ids(1) == (0, 1, 2) and kv.num_slots(1) == 12
    kv.check_integrity()
    kv.free(1)
    assert kv.num_available_blocks == 3
    # Freed last-first: the tail block (2) is handed out before the head (0).
    assert kv.allocate(3, 12) is not None and kv.block_ids(3) == (2, 1, 0)
    with pytest.raises(ValueError, match="already has"):
        kv.allocate(3, 1)
    with pytest.raises(KeyError):
        kv.free(1)
    kv.check_integrity()


def test_second_request_sharing_a_three_block_prefix_computes_only_its_new_tokens() -> None:
    kv = _manager(num_blocks=10)
    prefix = list(range(100, 112))  # exactly 3 blocks
    first = [*prefix, 1, 2]
    hit, ids = _start(kv, 1, first)
    assert hit == 0 and ids == [0, 1, 2, 3]
    second = [*prefix, 7, 8, 9]
    hit, ids = _start(kv, 2, second)
    assert hit == 12  # 3 blocks count as computed: only tokens 12..14 are new
    assert ids == [0, 1, 2, 4]
    assert kv.block_ref_counts(2) == (2, 2, 2, 1)
    usage = kv.usage()
    assert (usage.prefix_query_tokens, usage.prefix_hit_tokens) == (14 + 15, 12)
    assert usage.prefix_hit_rate == pytest.approx(12 / 29)


def test_a_full_prompt_hit_still_leaves_the_last_token_to_compute() -> None:
    kv = _manager()
    prompt = list(range(8))  # two full blocks
    _start(kv, 1, prompt)
    hit, ids = _start(kv, 2, prompt)
    assert hit == 4  # not 8: the last token must run to produce logits
    assert ids[0] == 0 and ids[1] != 1


def test_freed_cached_blocks_are_reused_until_evicted_lru_first() -> None:
    kv = _manager(num_blocks=4)
    _start(kv, 1, [1, 1, 1, 1, 2, 2, 2, 2, 0])  # blocks 0, 1 hashed; 2 plain
    kv.free(1)
    usage = kv.usage()
    assert (usage.num_used_blocks, usage.num_cached_free_blocks, usage.num_free_blocks) == (0, 2, 2)
    # A request sharing block 0 only revives it; the plain free blocks go first (3, 2).
    hit, ids = _start(kv, 2, [1, 1, 1, 1, 9, 9])
    assert hit == 4 and ids == [0, 3]
    # Next allocation takes plain block 2, then must evict: block 1 (the only cached free).
    assert kv.allocate(3, 8) is not None and kv.block_ids(3) == (2, 1)
    assert kv.usage().num_evictions == 1
    hit, _ = _start(kv, 4, [1, 1, 1, 1, 2, 2, 2, 2, 5], num_tokens=4)
    assert hit == 4  # block 0 still cached; block 1's prefix is gone
    kv.check_integrity()


def test_eviction_order_follows_release_order_across_sequences() -> None:
    kv = _manager(num_blocks=6)
    _start(kv, 1, [1] * 8 + [0])  # blocks 0, 1 hashed, 2 plain
    _start(kv, 2, [2] * 8 + [0])  # blocks 3, 4 hashed, 5 plain
    kv.free(2)  # cached free queue: 4, 3
    kv.free(1)  # ... then 1, 0
    assert kv.allocate(3, 4 * 4) is not None  # plain 5, 2, then evicts 4, 3
    assert kv.block_ids(3) == (5, 2, 4, 3)
    assert kv.allocate(4, 4) is not None and kv.block_ids(4) == (1,)
    kv.check_integrity()


def test_stale_prefix_hit_is_refused() -> None:
    kv = _manager(num_blocks=2)
    _start(kv, 1, [3, 3, 3, 3, 1])
    kv.free(1)
    chain = BlockHashChain(B)
    hit = kv.find_cached_prefix(chain, [3, 3, 3, 3, 5], 4)
    assert hit.num_tokens == 4
    assert kv.allocate(2, 8) is not None  # evicts the hit block
    with pytest.raises(StalePrefixHitError):
        kv.allocate(3, 5, hit)


def test_allocation_counts_revived_cached_blocks_against_the_free_pool() -> None:
    kv = _manager(num_blocks=3)
    _start(kv, 1, [4, 4, 4, 4, 4, 4, 4, 4, 1])  # 3 blocks, 2 hashed
    kv.free(1)
    chain = BlockHashChain(B)
    hit = kv.find_cached_prefix(chain, [4] * 8 + [2] * 9, 16)
    assert hit.num_tokens == 8
    assert kv.allocate(2, 17, hit) is None  # 2 revived + 3 new > 3 available
    assert kv.allocate(2, 12, hit) is not None
    kv.check_integrity()


def test_fork_shares_full_blocks_and_copies_a_partial_last_block() -> None:
    kv = _manager(num_blocks=8)
    _start(kv, 1, list(range(10)))  # blocks 0, 1 full, 2 holds tokens 8 and 9
    forked = kv.fork(1, 2, num_tokens=10)
    assert forked == BlockAllocation(new_block_ids=(0, 1, 3), num_slots=12,
                                     block_copy=BlockCopy(src_block_id=2, dst_block_id=3))
    assert kv.block_ids(2) == (0, 1, 3)
    assert kv.block_ref_counts(1) == (2, 2, 1)
    assert kv.cache_threshold(2) == 3 * B  # the two shared full blocks are cached already
    kv.check_integrity()
    forked = kv.fork(1, 3, num_tokens=8)  # a block boundary: nothing to copy
    assert forked == BlockAllocation((0, 1), 8, None)
    kv.free(1)
    kv.free(2)
    kv.free(3)
    assert kv.usage().num_used_blocks == 0
    kv.check_integrity()


def test_fork_without_a_free_block_for_the_copy_changes_nothing() -> None:
    kv = _manager(num_blocks=2)
    assert kv.allocate(1, 6) is not None
    assert kv.fork(1, 2, 6) is None
    assert not kv.has_table(2) and kv.block_ref_counts(1) == (1, 1)
    with pytest.raises(ValueError, match="slots"):
        kv.fork(1, 2, 9)
    kv.check_integrity()


def test_cache_full_blocks_registers_only_full_known_blocks() -> None:
    kv = _manager()
    tokens = list(range(11))
    chain = BlockHashChain(B)
    assert kv.allocate(1, 11) is not None
    assert kv.cache_full_blocks(1, chain, tokens, 3) == 0
    assert kv.cache_full_blocks(1, chain, tokens[:6], 11) == 1  # only 6 tokens known
    assert kv.cache_full_blocks(1, chain, tokens, 11) == 1
    assert kv.cache_full_blocks(1, chain, tokens, 11) == 0
    assert kv.usage().num_hashed_blocks == 2
    kv.check_integrity()


def test_prefix_caching_off_never_hits() -> None:
    kv = _manager(caching=False)
    _start(kv, 1, list(range(9)))
    hit, _ = _start(kv, 2, list(range(9)))
    assert hit == 0 and kv.usage().num_hashed_blocks == 0


def test_hash_chain_covers_the_whole_prefix_and_the_extra_key() -> None:
    a, b = BlockHashChain(2), BlockHashChain(2)
    a.extend([1, 2, 3, 4], 4)
    b.extend([9, 9, 3, 4], 4)
    assert a.hashes[1] != b.hashes[1]  # same block tokens, different parents
    c = BlockHashChain(2, extra_key=b"lora-1")
    c.extend([1, 2, 3, 4], 4)
    assert c.hashes[0] != a.hashes[0]
    assert a.hashes[0] == hash_block(None, [1, 2])
    assert a.copy().hashes == a.hashes


def test_check_integrity_catches_a_table_holding_a_block_twice() -> None:
    kv = _manager()
    assert kv.allocate(1, 8) is not None
    table = kv._tables[1]  # corrupt the internal table, as a bug in kvcache would
    table.blocks[1] = table.blocks[0]
    with pytest.raises(IntegrityError):
        kv.check_integrity()
