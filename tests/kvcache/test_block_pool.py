"""BlockPool and its eviction queue: exact block ids, states and eviction order."""

from __future__ import annotations

import pytest

from kvcache.block_pool import BlockPool
from kvcache.errors import IntegrityError
from kvcache.free_queue import EvictionQueue, KVBlock
from kvcache.hashing import BlockHash, hash_block


def _hash(n: int) -> BlockHash:
    return hash_block(None, [n])


def _refs(pool: BlockPool) -> dict[int, int]:
    return {b.block_id: b.ref_count for b in pool.blocks if b.ref_count}


def test_eviction_queue_removes_from_the_middle_and_pops_oldest_first() -> None:
    queue = EvictionQueue()
    blocks = [KVBlock(i) for i in range(5)]
    for block in blocks:
        queue.append(block)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4]
    assert len(queue) == 3
    assert blocks[2].prev is None and blocks[2].next is None
    assert queue.pop_oldest().block_id == 1
    queue.append(blocks[0])
    assert [b.block_id for b in queue.check_links()] == [3, 4, 0]
    for expected in (3, 4, 0):
        assert queue.pop_oldest().block_id == expected
    with pytest.raises(IndexError):
        queue.pop_oldest()


def test_take_hands_out_ids_in_order_and_release_returns_them_to_the_tail() -> None:
    pool = BlockPool(6, enable_caching=True)
    first = pool.take(3)
    assert [b.block_id for b in first] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in first)
    pool.release([first[1]])
    assert [b.block_id for b in pool.take(4)] == [3, 4, 5, 1]
    assert pool.num_available_blocks == 0
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1})


def test_cached_blocks_outlive_plain_free_ones_and_are_evicted_lru_first() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.take(5)
    for i in (0, 1, 2):
        assert pool.register(blocks[i], _hash(i))
    # Released in this order: 2 (cached), 4 (plain), 0 (cached), 1 (cached), 3 (plain).
    pool.release([blocks[2], blocks[4], blocks[0], blocks[1], blocks[3]])
    assert pool.num_plain_free_blocks == 2 and pool.num_cached_free_blocks == 3
    pool.check_integrity({})
    # Plain free blocks first (4, 3), then cached ones, least recently released first.
    order = [pool.take(1)[0].block_id for _ in range(5)]
    assert order == [4, 3, 2, 0, 1]
    assert pool.num_evictions == 3
    assert pool.lookup(_hash(0)) is None and pool.num_hashed_blocks == 0


def test_acquire_revives_a_cached_free_block_out_of_the_middle_of_the_queue() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.take(3)
    for i, block in enumerate(blocks):
        pool.register(block, _hash(i))
    pool.release(blocks)
    hit = pool.lookup(_hash(1))
    assert hit is blocks[1]
    pool.acquire([hit])
    assert hit.ref_count == 1 and pool.num_cached_free_blocks == 2
    pool.check_integrity({1: 1})
    assert [pool.take(1)[0].block_id for _ in range(2)] == [0, 2]


def test_register_keeps_the_first_block_for_a_hash_and_respects_the_switch() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, _ = pool.take(3)
    assert pool.register(a, _hash(7))
    assert not pool.register(b, _hash(7))  # duplicate content: b stays plain
    assert not pool.register(a, _hash(8))  # a block carries one hash
    assert b.block_hash is None and pool.lookup(_hash(7)) is a
    off = BlockPool(1, enable_caching=False)
    (c,) = off.take(1)
    assert not off.register(c, _hash(1)) and c.block_hash is None


def test_reset_prefix_cache_turns_cached_free_blocks_into_free_ones() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.take(4)
    for i, block in enumerate(blocks):
        pool.register(block, _hash(i))
    pool.release(blocks[:3])
    assert pool.reset_prefix_cache() == 4
    assert pool.num_plain_free_blocks == 3 and pool.num_hashed_blocks == 0
    assert blocks[3].block_hash is None  # in use, but its hash is gone too
    pool.check_integrity({3: 1})


def test_check_integrity_catches_wrong_counts_and_states() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.take(2)
    with pytest.raises(IntegrityError, match="block tables hold it"):
        pool.check_integrity({0: 1})  # block 1 is in use but no table holds it
    pool.check_integrity({0: 1, 1: 1})
    blocks[0].ref_count = 0  # in use by the lists' reckoning, count says free
    with pytest.raises(IntegrityError):
        pool.check_integrity({0: 0, 1: 1})
    blocks[0].ref_count = 1
    pool.register(blocks[1], _hash(1))
    pool.release([blocks[1]])
    blocks[1].block_hash = _hash(99)  # index and block disagree
    with pytest.raises(IntegrityError, match="hash"):
        pool.check_integrity({0: 1})
