"""``KVCacheManager``: block tables of sequences over one ``BlockPool``, with prefix caching."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence

from kvcache.block_pool import BlockPool
from kvcache.block_table import BlockTable
from kvcache.config import KVCacheConfig
from kvcache.errors import StalePrefixHitError
from kvcache.free_queue import KVBlock
from kvcache.hashing import BlockHashChain
from kvcache.records import BlockAllocation, BlockCopy, KVCacheUsage, PrefixHit


class KVCacheManager:
    """Allocates, grows, forks and frees the block tables of sequences; the only owner of both.

    Logical only: it decides which block ids a sequence uses; each stage maps the ids into its
    own physical pool. Callers name sequences by id, learn what a call changed from the
    immutable ``BlockAllocation`` it returns, and ask the query methods for the rest. Methods
    that can run out of blocks return None and change nothing; a caller error (unknown or
    duplicate sequence id, a bad token count) raises.

    Prefix caching: a full block is registered under its chained hash once the caller says its
    tokens are final and scheduled (``cache_full_blocks``). A new sequence's leading full blocks
    that hit count as computed. Blocks freed with a hash stay reusable until evicted. The
    caller owns each sequence's ``BlockHashChain`` and passes it in.
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

    @property
    def num_seqs(self) -> int:
        """Sequences holding a block table."""
        return len(self._tables)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` slots."""
        return -(-num_tokens // self.block_size)

    # --- queries, keyed by sequence id; none mutates anything --------------------------------

    def has_table(self, seq_id: int) -> bool:
        """Whether ``seq_id`` holds a block table."""
        return seq_id in self._tables

    def num_slots(self, seq_id: int) -> int:
        """Token slots ``seq_id`` holds: its blocks times the block size.

        Raises:
            KeyError: ``seq_id`` has no table.
        """
        return len(self._tables[seq_id].blocks) * self.block_size

    def block_ids(self, seq_id: int, start: int = 0) -> tuple[int, ...]:
        """The ids of the blocks of ``seq_id`` from block index ``start`` on, in position order.

        ``start=0`` gives the whole table (what a plan sends for a sequence the stages do not
        know); ``start=n`` the blocks after the first ``n`` (a diff after ``n`` were sent).

        Raises:
            KeyError: ``seq_id`` has no table.
        """
        return self._tables[seq_id].block_ids_from(start)

    def cache_threshold(self, seq_id: int) -> int:
        """Tokens at which the next full block of ``seq_id`` can be registered in the cache.

        ``cache_full_blocks(seq_id, chain, token_ids, n)`` registers (or finds registered) at
        least one more block exactly when ``min(n, len(token_ids))`` reaches this count (the
        slots hold it: a caller passes at most the tokens it computed), and does nothing
        below it. It is ``(blocks already offered + 1) * block_size``, or ``sys.maxsize``
        (no count reaches it) when prefix caching is off; only ``allocate``, ``fork`` and
        ``cache_full_blocks`` change it.

        Raises:
            KeyError: ``seq_id`` has no table.
        """
        cached = self._tables[seq_id].cached_hashes
        if not self.config.enable_prefix_caching:
            return sys.maxsize
        return (len(cached) + 1) * self.block_size

    def block_ref_counts(self, seq_id: int) -> tuple[int, ...]:
        """How many tables hold each block of ``seq_id``, in position order (1: private;
        more: shared through prefix hits or forks). For tests, metrics and debugging.

        Raises:
            KeyError: ``seq_id`` has no table.
        """
        return tuple([block.ref_count for block in self._tables[seq_id].blocks])

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
        block_ids: list[int] = []
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
                block_ids.append(block.block_id)
        return PrefixHit(
            block_ids=tuple(block_ids),
            hashes=tuple(hash_chain.hashes[: len(block_ids)]),
            num_tokens=len(block_ids) * size,
            num_queried_tokens=len(token_ids),
        )

    # --- mutations -----------------------------------------------------------------------

    def allocate(
        self, seq_id: int, num_tokens: int, prefix: PrefixHit | None = None
    ) -> BlockAllocation | None:
        """Create the block table of a new sequence with room for ``num_tokens`` slots.

        Args:
            seq_id: a sequence with no table.
            num_tokens: slots wanted, the prefix hit included.
            prefix: a hit from ``find_cached_prefix`` just before; its blocks come first and
                count as offered to the prefix cache already (see ``cache_threshold``).

        Returns:
            The allocation (``new_block_ids`` is the whole table), or None (nothing changed)
            when the pool lacks blocks.

        Raises:
            ValueError: ``seq_id`` already has a table, or ``num_tokens`` is below the hit.
            StalePrefixHitError: a block of ``prefix`` was evicted since the lookup.

        Mutates: the tables, the pool (references, free lists), the usage counters.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        hit: list[KVBlock] = []
        if prefix is not None:
            hit = [self._pool.blocks[block_id] for block_id in prefix.block_ids]
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
        table = BlockTable(seq_id, blocks, list(prefix.hashes) if prefix is not None else [])
        if prefix is not None:
            self._prefix_query_tokens += prefix.num_queried_tokens
            self._prefix_hit_tokens += prefix.num_tokens
        self._tables[seq_id] = table
        return BlockAllocation(table.block_ids_from(0), len(blocks) * self.block_size)

    def append_slots(self, seq_id: int, num_tokens: int) -> BlockAllocation | None:
        """Grow the table of ``seq_id`` to at least ``num_tokens`` slots.

        Returns:
            The allocation (``new_block_ids`` empty if the table had room already), or None
            (nothing changed) when the pool lacks blocks.

        Raises:
            KeyError: ``seq_id`` has no table.

        Mutates: the table and the pool.
        """
        blocks = self._tables[seq_id].blocks
        num_new = -(-num_tokens // self.block_size) - len(blocks)
        if num_new <= 0:
            return BlockAllocation((), len(blocks) * self.block_size)
        if num_new > self._pool.num_available_blocks:
            return None
        new_blocks = self._pool.take(num_new)
        blocks += new_blocks
        new_ids = tuple([block.block_id for block in new_blocks])
        return BlockAllocation(new_ids, len(blocks) * self.block_size)

    def cache_full_blocks(
        self, seq_id: int, hash_chain: BlockHashChain, token_ids: Sequence[int], num_tokens: int
    ) -> int:
        """Register the full blocks within the first ``num_tokens`` tokens in the prefix cache.

        Call once the tokens are final and their KV is computed or scheduled in a step that
        was already sent (stages run steps in order, so any later reader sees the KV). Does
        nothing below ``cache_threshold(seq_id)``.

        Args:
            seq_id: a sequence with a table.
            hash_chain: its chain (the one its prefix was looked up with, or a fork's copy of
                its parent's); missing hashes are computed and kept.
            token_ids: its token history (only the first ``num_tokens`` are hashed).
            num_tokens: tokens known and scheduled.

        Returns:
            How many blocks were newly registered (a block whose hash another block holds
            already is passed over, not registered).

        Raises:
            KeyError: ``seq_id`` has no table.
            ValueError: ``hash_chain`` disagrees with the hashes of the blocks offered before.

        Mutates: the table (``cache_threshold`` moves past the last full block), ``hash_chain``
        and the prefix-cache index.
        """
        table = self._tables[seq_id]
        cached = table.cached_hashes
        start = len(cached)
        num_full = min(num_tokens, len(token_ids), len(table.blocks) * self.block_size)
        num_full //= self.block_size
        if num_full <= start or not self.config.enable_prefix_caching:
            return 0
        hashes = hash_chain.hashes
        if start and (len(hashes) < start or hashes[start - 1] != cached[-1]):
            raise ValueError(f"sequence {seq_id}: the hash chain is not the sequence's own")
        if len(hashes) < num_full:
            hash_chain.extend(token_ids, num_full * self.block_size)
        blocks, register = table.blocks, self._pool.register
        registered = 0
        for index in range(start, num_full):
            registered += register(blocks[index], hashes[index])
        cached += hashes[start:num_full]
        return registered

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> BlockAllocation | None:
        """Give ``child_id`` the KV of the first ``num_tokens`` tokens of ``parent_id``.

        Full blocks are shared (one more reference each; full blocks are never written again,
        so sharing them is copy-on-write with no copy). A partly filled last block is copied
        into a fresh block, because parent and child will write different tokens into it. The
        child's hash chain is the caller's: a copy of the parent's.

        Returns:
            The child's allocation (``new_block_ids`` is its whole table; ``block_copy`` the
            copy the stages must make, None if ``num_tokens`` is a multiple of the block
            size), or None (nothing changed) if no block is free for the copy.

        Raises:
            KeyError: the parent has no table. ValueError: the child has one, or the parent
                has fewer than ``num_tokens`` slots.

        Mutates: the tables and the pool.
        """
        parent = self._tables[parent_id]
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        if num_tokens > len(parent.blocks) * self.block_size:
            raise ValueError(f"parent {parent_id} holds {self.num_slots(parent_id)} < "
                             f"{num_tokens} slots")
        num_full, partial = divmod(num_tokens, self.block_size)
        if partial and self._pool.num_available_blocks == 0:
            return None
        blocks = parent.blocks[:num_full]
        self._pool.acquire(blocks)
        copy = None
        if partial:
            (fresh,) = self._pool.take(1)
            copy = BlockCopy(parent.blocks[num_full].block_id, fresh.block_id)
            blocks.append(fresh)
        table = BlockTable(child_id, blocks, parent.cached_hashes[:num_full])
        self._tables[child_id] = table
        return BlockAllocation(table.block_ids_from(0), len(blocks) * self.block_size, copy)

    def free(self, seq_id: int) -> None:
        """Drop the table of ``seq_id``, releasing its blocks last-first.

        Releasing the tail first puts it ahead of the prefix in the eviction queue: a shared
        prompt outlives the sequence-specific tail.

        Raises:
            KeyError: ``seq_id`` has no table.

        Mutates: the tables and the pool.
        """
        table = self._tables.pop(seq_id)
        self._pool.release(reversed(table.blocks))

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (a stage lost its KV). Returns how many were dropped.

        Mutates: the pool's prefix-cache index and every hashed block.
        """
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
            table.check_integrity(seq_id)
            refs.update(block.block_id for block in table.blocks)
        self._pool.check_integrity(refs)

