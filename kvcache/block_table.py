"""Per-sequence block tables and the small immutable records the manager hands out."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.free_queue import KVBlock
from kvcache.hashing import BlockHash, BlockHashChain


class BlockTable:
    """The blocks of one sequence, in position order.

    Slot ``p`` of the sequence is offset ``p % block_size`` of ``blocks[p // block_size]``.
    Owned and mutated only by ``KVCacheManager``; everyone else reads it.

    Attributes:
        seq_id: the sequence.
        blocks: the table; each block holds one reference from this table.
        hash_chain: hashes of the sequence's full blocks (shared with the caller, who keeps it
            across preemptions because the token history only grows).
        num_cached_blocks: leading blocks already looked up or registered in the prefix cache;
            the next ``cache_full_blocks`` starts there.
        num_slots: ``len(blocks) * block_size``, kept as a field for the scheduler's hot path.
    """

    __slots__ = ("block_size", "blocks", "hash_chain", "num_cached_blocks", "num_slots", "seq_id")

    def __init__(
        self, seq_id: int, blocks: list[KVBlock], hash_chain: BlockHashChain, block_size: int
    ) -> None:
        self.seq_id = seq_id
        self.blocks = blocks
        self.hash_chain = hash_chain
        self.block_size = block_size
        self.num_cached_blocks = 0
        self.num_slots = len(blocks) * block_size

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The block ids, in position order."""
        return tuple(block.block_id for block in self.blocks)

    def block_ids_from(self, start: int) -> tuple[int, ...]:
        """The ids of ``blocks[start:]`` (what a diff sends when ``start`` were sent before)."""
        return tuple(block.block_id for block in self.blocks[start:])

    def __repr__(self) -> str:
        return f"BlockTable(seq_id={self.seq_id}, block_ids={list(self.block_ids)})"


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy block ``src_block_id`` into ``dst_block_id`` on every stage before the step runs.

    Emitted when a fork gives the child its own copy of the parent's partly filled last block.
    """

    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Leading full blocks of a token sequence found in the prefix cache.

    Valid until the pool next changes: ``KVCacheManager.allocate`` raises ``StalePrefixHitError`` if
    one of the blocks was evicted (or re-registered) meanwhile.

    Attributes:
        blocks: the cached blocks, in position order.
        hashes: their hashes, to detect staleness.
        num_tokens: tokens covered (``len(blocks) * block_size``); they count as computed.
        num_queried_tokens: tokens the lookup was for (the prefix hit-rate denominator).
    """

    blocks: tuple[KVBlock, ...]
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
