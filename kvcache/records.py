"""The immutable records ``KVCacheManager`` hands out: what a call changed, a prefix hit, usage.

The manager owns every block and block table; callers learn about them only through these
records and the manager's query methods, keyed by sequence id.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy block ``src_block_id`` into ``dst_block_id`` on every stage before the step runs.

    Emitted when a fork gives the child its own copy of the parent's partly filled last block.
    """

    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True, slots=True)
class BlockAllocation:
    """What ``allocate``, ``append_slots`` or ``fork`` did to one sequence's block table.

    Attributes:
        new_block_ids: ids of the blocks this call added to the end of the table, in position
            order: the whole table for ``allocate`` and ``fork`` (prefix hits and shared blocks
            included), only the appended ones for ``append_slots`` (empty if it had room).
        num_slots: token slots the sequence holds after the call (blocks times block size).
        block_copy: for a ``fork`` whose fork point falls inside a block, the copy of that
            partly filled block the stages must make; else None.
    """

    new_block_ids: tuple[int, ...]
    num_slots: int
    block_copy: BlockCopy | None = None


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Leading full blocks of a token sequence found in the prefix cache.

    Valid until the pool next changes: ``KVCacheManager.allocate`` raises
    ``StalePrefixHitError`` if one of the blocks was evicted (or re-registered) meanwhile.

    Attributes:
        block_ids: the cached blocks, in position order.
        hashes: their hashes, to detect staleness.
        num_tokens: tokens covered (``len(block_ids) * block_size``); they count as computed.
        num_queried_tokens: tokens the lookup was for (the prefix hit-rate denominator).
    """

    block_ids: tuple[int, ...]
    hashes: tuple[BlockHash, ...]
    num_tokens: int
    num_queried_tokens: int


@dataclass(frozen=True, slots=True)
class KVCacheUsage:
    """A snapshot of the pool.

    ``num_used_blocks + num_cached_free_blocks + num_free_blocks == num_blocks`` always.
    """

    num_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_free_blocks: int
    num_hashed_blocks: int
    num_evictions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int

    @property
    def prefix_hit_rate(self) -> float:
        """Tokens found in the prefix cache over tokens looked up (0.0 before any lookup)."""
        if self.prefix_query_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences."""
        return self.num_used_blocks / self.num_blocks
