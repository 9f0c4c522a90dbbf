"""What callers of KVCacheManager see: immutable allocation records and queries by sequence id."""

from __future__ import annotations

import dataclasses
import sys

import pytest

import kvcache
from kvcache import BlockAllocation, BlockCopy, BlockHashChain, KVCacheConfig, KVCacheManager

B = 4  # block size in these tests


def _manager(num_blocks: int = 8, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=B,
                                        enable_prefix_caching=caching))


def test_block_tables_are_internal_to_kvcache() -> None:
    assert "BlockTable" not in kvcache.__all__ and not hasattr(kvcache, "BlockTable")
    kv = _manager()
    assert not any(name in dir(kv) for name in ("get_table", "tables"))


def test_allocation_records_are_frozen_slotted_values() -> None:
    kv = _manager()
    allocation = kv.allocate(1, 6)
    assert allocation == BlockAllocation(new_block_ids=(0, 1), num_slots=8, block_copy=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        allocation.num_slots = 12  # type: ignore[misc]
    assert not hasattr(allocation, "__dict__")  # slots: no attribute can be added either
    assert hash(allocation) == hash(BlockAllocation((0, 1), 8))
    grown = kv.append_slots(1, 9)
    assert grown == BlockAllocation((2,), 12)
    assert allocation == BlockAllocation((0, 1), 8)  # an earlier record never changes
    kv.check_integrity()


def test_records_give_exact_ids_and_slot_counts_as_a_table_grows() -> None:
    kv = _manager(num_blocks=8)
    expected_ids: list[int] = []
    for num_tokens, new_ids in ((1, (0,)), (4, ()), (5, (1,)), (13, (2, 3)), (16, ())):
        allocation = (kv.allocate(7, num_tokens) if not kv.has_table(7)
                      else kv.append_slots(7, num_tokens))
        expected_ids += new_ids
        slots = len(expected_ids) * B
        assert allocation == BlockAllocation(new_ids, slots), num_tokens
        assert kv.block_ids(7) == tuple(expected_ids) and kv.num_slots(7) == slots
    assert kv.block_ids(7, 2) == (2, 3) and kv.block_ids(7, 4) == ()
    assert kv.num_seqs == 1 and kv.block_ref_counts(7) == (1, 1, 1, 1)


def test_allocate_with_a_prefix_hit_reports_the_whole_table() -> None:
    kv = _manager(num_blocks=8)
    prompt = list(range(10))
    chain = BlockHashChain(B)
    first = kv.allocate(1, 10, kv.find_cached_prefix(chain, prompt, 9))
    assert first == BlockAllocation((0, 1, 2), 12)
    kv.cache_full_blocks(1, chain, prompt, 10)
    hit = kv.find_cached_prefix(BlockHashChain(B), prompt, 9)
    assert hit.block_ids == (0, 1) and hit.num_tokens == 8
    assert kv.allocate(2, 10, hit) == BlockAllocation((0, 1, 3), 12)
    assert kv.block_ref_counts(2) == (2, 2, 1) and kv.num_seqs == 2
    kv.check_integrity()


def test_fork_record_carries_the_block_copy() -> None:
    kv = _manager(num_blocks=8)
    assert kv.allocate(1, 7) is not None
    forked = kv.fork(1, 2, 7)
    assert forked == BlockAllocation((0, 2), 8, BlockCopy(src_block_id=1, dst_block_id=2))
    assert kv.block_ids(2) == (0, 2) and kv.num_slots(2) == 8


def test_cache_threshold_follows_hits_forks_and_registrations() -> None:
    kv = _manager(num_blocks=16)
    tokens = list(range(13))
    chain = BlockHashChain(B)
    assert kv.allocate(1, 13) is not None
    assert kv.cache_threshold(1) == B  # nothing cached: block 0 can go once 4 tokens are in
    kv.cache_full_blocks(1, chain, tokens, B - 1)
    assert kv.cache_threshold(1) == B  # below the threshold: nothing happened
    kv.cache_full_blocks(1, chain, tokens, 9)
    assert kv.cache_threshold(1) == 3 * B  # blocks 0 and 1 registered
    hit = kv.find_cached_prefix(BlockHashChain(B), tokens, 12)
    assert kv.allocate(2, 13, hit) is not None
    assert kv.cache_threshold(2) == 3 * B  # the two hit blocks count as cached
    assert kv.fork(1, 3, 13) is not None
    assert kv.cache_threshold(3) == 3 * B  # shares the parent's cached blocks
    assert kv.cache_threshold(1) == 3 * B  # the parent is unchanged by the fork
    off = _manager(caching=False)
    assert off.allocate(1, 8) is not None and off.cache_threshold(1) == sys.maxsize


def test_cache_full_blocks_refuses_a_chain_of_other_tokens() -> None:
    kv = _manager()
    assert kv.allocate(1, 8) is not None
    kv.cache_full_blocks(1, BlockHashChain(B), [1] * 8, 4)
    with pytest.raises(ValueError, match="not the sequence's own"):
        kv.cache_full_blocks(1, BlockHashChain(B), [1] * 8, 8)  # a fresh chain: no hashes
    other = BlockHashChain(B)
    other.extend([2] * 8, 8)
    with pytest.raises(ValueError, match="not the sequence's own"):
        kv.cache_full_blocks(1, other, [1] * 8, 8)
    kv.check_integrity()


@pytest.mark.parametrize("query", ["num_slots", "block_ids", "cache_threshold",
                                   "block_ref_counts", "append_slots", "free"])
def test_calls_naming_a_sequence_without_blocks_raise_key_error(query: str) -> None:
    kv = _manager()
    assert not kv.has_table(5)
    with pytest.raises(KeyError):
        getattr(kv, query)(5, *((8,) if query == "append_slots" else ()))
