"""``KVCacheManager``: block tables of sequences over one ``BlockPool``, with prefix caching."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvcache.block_pool import BlockPool
from kvcache.block_table import BlockCopy, BlockTable, KVCacheUsage, PrefixHit
from kvcache.config import KVCacheConfig
from kvcache.errors import IntegrityError, StalePrefixHitError
from kvcache.free_queue import KVBlock
from kvcache.hashing import BlockHashChain


class KVCacheManager:
    """Allocates, grows, forks and frees the block tables of sequences.

    Logical only: it decides which block ids a sequence uses; each stage maps the ids into its
    own physical pool. Methods that can run out of blocks return None and change nothing; a
    caller error (unknown or duplicate sequence id, a bad token count) raises.

    Prefix caching: a full block is registered under its chained hash once the caller says its
    tokens are final and scheduled (``cache_full_blocks``). A new sequence's leading full blocks
    that hit count as computed. Blocks freed with a hash stay reusable until evicted.
    """

    def __init__(self, config: KVCacheConfig) -> None:
        """Build an empty pool from ``config``."""
        self.config = config
        self.block_size = config.block_size
        self._pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self._tables: dict[int, BlockTable] = {}
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached free)."""
        return self._pool.num_available_blocks

    def has_table(self, seq_id: int) -> bool:
        """Whether ``seq_id`` holds a block table."""
        return seq_id in self._tables

    def get_table(self, seq_id: int) -> BlockTable:
        """The block table of ``seq_id``. Raises KeyError if it has none."""
        return self._tables[seq_id]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` slots."""
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(
        self, hash_chain: BlockHashChain, token_ids: Sequence[int], max_tokens: int
    ) -> PrefixHit:
        """Look up the leading full blocks of ``token_ids`` in the prefix cache.

        Args:
            hash_chain: the sequence's chain; missing hashes are computed and kept, but only up
                to the first miss.
            token_ids: the sequence's tokens.
            max_tokens: hit at most this many tokens (callers pass ``len(token_ids) - 1`` so
                that at least the last token is computed and yields logits).

        Returns:
            The hit (possibly empty). Mutates only ``hash_chain``.
        """
        size = self.block_size
        blocks: list[KVBlock] = []
        if self.config.enable_prefix_caching:
            hashes = hash_chain.hashes
            for index in range(max(0, max_tokens) // size):
                if index < len(hashes):
                    block_hash = hashes[index]
                else:
                    block_hash = hash_chain.extend_one(token_ids[index * size : (index + 1) * size])
                block = self._pool.lookup(block_hash)
                if block is None:
                    break
                blocks.append(block)
        return PrefixHit(
            blocks=tuple(blocks),
            hashes=tuple(hash_chain.hashes[: len(blocks)]),
            num_tokens=len(blocks) * size,
            num_queried_tokens=len(token_ids),
        )

    def allocate(
        self,
        seq_id: int,
        num_tokens: int,
        hash_chain: BlockHashChain | None = None,
        prefix: PrefixHit | None = None,
    ) -> BlockTable | None:
        """Create the block table of a new sequence with room for ``num_tokens`` slots.

        Args:
            seq_id: a sequence with no table.
            num_tokens: slots wanted, the prefix hit included.
            hash_chain: the sequence's chain (kept by the table); a fresh one if None.
            prefix: a hit from ``find_cached_prefix`` just before; its blocks come first.

        Returns:
            The table, or None (nothing changed) when the pool lacks blocks.

        Raises:
            ValueError: ``seq_id`` already has a table, ``num_tokens`` is below the hit, or a
                hit comes without its chain.
            StalePrefixHitError: a block of ``prefix`` was evicted since the lookup.

        Mutates: the pool (references, free lists), the usage counters.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        hit = prefix.blocks if prefix is not None else ()
        if prefix is not None:
            if hash_chain is None:
                raise ValueError("a prefix hit needs the hash chain it was looked up with")
            if any(b.block_hash != h for b, h in zip(hit, prefix.hashes, strict=True)):
                raise StalePrefixHitError(f"sequence {seq_id}: a prefix block was evicted")
            if num_tokens < prefix.num_tokens:
                raise ValueError(f"num_tokens {num_tokens} is below the hit {prefix.num_tokens}")
        num_new = self.blocks_needed(num_tokens) - len(hit)
        num_revived = sum(1 for block in hit if block.ref_count == 0)
        if num_new + num_revived > self._pool.num_available_blocks:
            return None
        self._pool.acquire(hit)
        blocks = [*hit, *self._pool.take(num_new)]
        chain = hash_chain if hash_chain is not None else BlockHashChain(self.block_size)
        table = BlockTable(seq_id, blocks, chain, self.block_size)
        table.num_cached_blocks = len(hit)
        if prefix is not None:
            self._prefix_query_tokens += prefix.num_queried_tokens
            self._prefix_hit_tokens += prefix.num_tokens
        self._tables[seq_id] = table
        return table

    def append_slots(self, seq_id: int, num_tokens: int) -> tuple[int, ...] | None:
        """Grow the table of ``seq_id`` to at least ``num_tokens`` slots.

        Returns:
            The ids of the blocks appended (empty if it already had room), or None (nothing
            changed) when the pool lacks blocks.

        Raises:
            KeyError: ``seq_id`` has no table.

        Mutates: the table and the pool.
        """
        table = self._tables[seq_id]
        if num_tokens <= table.num_slots:
            return ()
        num_new = -(-num_tokens // self.block_size) - len(table.blocks)
        if num_new > self._pool.num_available_blocks:
            return None
        new_blocks = self._pool.take(num_new)
        table.blocks += new_blocks
        table.num_slots = len(table.blocks) * self.block_size
        return tuple([block.block_id for block in new_blocks])

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> int:
        """Register the full blocks within the first ``num_tokens`` tokens in the prefix cache.

        Call once the tokens are final and their KV is computed or scheduled in a step that
        was already sent (stages run steps in order, so any later reader sees the KV).

        Args:
            seq_id: a sequence with a table.
            token_ids: its token history (only the first ``num_tokens`` are hashed).
            num_tokens: tokens known and scheduled.

        Returns:
            How many blocks were newly registered. Mutates the table, its chain and the index.
        """
        table = self._tables[seq_id]
        num_full = min(num_tokens, len(token_ids), table.num_slots) // self.block_size
        start = table.num_cached_blocks
        if num_full <= start or not self.config.enable_prefix_caching:
            return 0
        chain = table.hash_chain
        if len(chain.hashes) < num_full:
            chain.extend(token_ids, num_full * self.block_size)
        hashes, blocks, register = chain.hashes, table.blocks, self._pool.register
        registered = 0
        for index in range(start, num_full):
            registered += register(blocks[index], hashes[index])
        table.num_cached_blocks = num_full
        return registered

    def fork(
        self, parent_id: int, child_id: int, num_tokens: int
    ) -> tuple[BlockTable, BlockCopy | None] | None:
        """Give ``child_id`` the KV of the first ``num_tokens`` tokens of ``parent_id``.

        Full blocks are shared (one more reference each; full blocks are never written again,
        so sharing them is copy-on-write with no copy). A partly filled last block is copied
        into a fresh block, because parent and child will write different tokens into it.

        Returns:
            The child's table and the copy the stages must make (None if ``num_tokens`` is a
            multiple of the block size), or None (nothing changed) if no block is free.

        Raises:
            KeyError: the parent has no table. ValueError: the child has one, or the parent
                has fewer than ``num_tokens`` slots.
        """
        parent = self._tables[parent_id]
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        if num_tokens > parent.num_slots:
            raise ValueError(f"parent {parent_id} holds {parent.num_slots} < {num_tokens} slots")
        num_full, partial = divmod(num_tokens, self.block_size)
        if partial and self._pool.num_available_blocks == 0:
            return None
        shared = parent.blocks[:num_full]
        self._pool.acquire(shared)
        blocks = list(shared)
        copy = None
        if partial:
            (fresh,) = self._pool.take(1)
            copy = BlockCopy(parent.blocks[num_full].block_id, fresh.block_id)
            blocks.append(fresh)
        table = BlockTable(child_id, blocks, parent.hash_chain.copy(), self.block_size)
        table.num_cached_blocks = min(parent.num_cached_blocks, num_full)
        self._tables[child_id] = table
        return table, copy

    def free(self, seq_id: int) -> None:
        """Drop the table of ``seq_id``, releasing its blocks last-first.

        Releasing the tail first puts it ahead of the prefix in the eviction queue: a shared
        prompt outlives the sequence-specific tail. Raises KeyError if it has no table.
        """
        table = self._tables.pop(seq_id)
        self._pool.release(reversed(table.blocks))

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (a stage lost its KV). Returns how many were dropped."""
        return self._pool.reset_prefix_cache()

    def usage(self) -> KVCacheUsage:
        """A snapshot of block states and prefix-cache counters. O(1)."""
        pool = self._pool
        return KVCacheUsage(
            num_blocks=self.config.num_blocks,
            num_used_blocks=self.config.num_blocks - pool.num_available_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_free_blocks=pool.num_plain_free_blocks,
            num_hashed_blocks=pool.num_hashed_blocks,
            num_evictions=pool.num_evictions,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
        )

    def check_integrity(self) -> None:
        """Verify pool, tables and prefix cache agree. O(blocks + table entries).

        Raises:
            IntegrityError: a block is in no single state, a reference count differs from the
                number of tables holding the block, or a table is malformed.
        """
        refs: Counter[int] = Counter()
        for seq_id, table in self._tables.items():
            self._check_table(seq_id, table)
            refs.update(block.block_id for block in table.blocks)
        self._pool.check_integrity(refs)

    def _check_table(self, seq_id: int, table: BlockTable) -> None:
        ids = table.block_ids
        if table.seq_id != seq_id or len(set(ids)) != len(ids):
            raise IntegrityError(f"table of {seq_id} is malformed: {table}")
        if table.num_slots != len(ids) * self.block_size:
            raise IntegrityError(f"table of {seq_id}: num_slots {table.num_slots} is stale")
        if table.num_cached_blocks > len(ids):
            raise IntegrityError(f"table of {seq_id}: more cached blocks than blocks")
        chain = table.hash_chain.hashes
        for index, block in enumerate(table.blocks[: len(chain)]):
            if block.block_hash is not None and block.block_hash != chain[index]:
                raise IntegrityError(f"table of {seq_id}: block {index} holds other tokens' KV")
