"""The pool of logical KV blocks: reference counts, free lists and the prefix-cache index."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from kvcache.errors import IntegrityError
from kvcache.free_queue import EvictionQueue, KVBlock
from kvcache.hashing import BlockHash


class BlockPool:
    """Owns every ``KVBlock`` and which of the three states each one is in.

    Allocation takes never-hashed free blocks first (oldest freed first) and only then evicts
    cached free blocks, least recently used first, so cached prefixes live as long as possible.
    Every operation is O(number of blocks it touches); nothing walks the whole pool except
    ``check_integrity`` and ``reset_prefix_cache``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        """Create ``num_blocks`` free blocks with ids ``0 .. num_blocks - 1``.

        Args:
            num_blocks: size of the pool.
            enable_caching: whether ``register`` records hashes at all.
        """
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # ref_count == 0, block_hash is None; allocated from the left, freed to the right.
        self._free: deque[KVBlock] = deque(self.blocks)
        # ref_count == 0, block_hash set; evicted from the head (least recently used).
        self._evictable = EvictionQueue()
        # hash -> the one block registered under it (in use or cached free).
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_available_blocks(self) -> int:
        """Blocks that ``take`` can hand out now: free plus cached free."""
        return len(self._free) + len(self._evictable)

    @property
    def num_plain_free_blocks(self) -> int:
        """Free blocks that hold no cached prefix."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Blocks with no user that still hold a reusable cached prefix."""
        return len(self._evictable)

    @property
    def num_hashed_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or not."""
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The block registered under ``block_hash``, if any. Mutates nothing."""
        return self._cached.get(block_hash)

    def take(self, count: int) -> list[KVBlock]:
        """Hand out ``count`` blocks with one reference each, evicting cached ones if needed.

        Args:
            count: blocks wanted; the caller has checked ``count <= num_available_blocks``.

        Returns:
            The blocks, in the order handed out.

        Mutates: the free lists, the prefix-cache index (evicted hashes are dropped).
        """
        taken: list[KVBlock] = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block = self._evictable.pop_oldest()
                self._drop_hash(block)
                self.num_evictions += 1
            block.ref_count = 1
            taken.append(block)
        return taken

    def acquire(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each of ``blocks`` (prefix hits, forks).

        A cached free block leaves the eviction queue. Mutates reference counts.
        """
        for block in blocks:
            if block.ref_count == 0:
                self._evictable.remove(block)
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each of ``blocks``, in the given order.

        A block whose count reaches zero joins the tail of the eviction queue if it is hashed,
        else the tail of the free deque; so among blocks released together, the first released
        is evicted first. Mutates reference counts and the free lists.
        """
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"{block} released more often than acquired"
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.append(block)
                else:
                    self._evictable.append(block)

    def register(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Record that in-use ``block`` holds the full block hashed ``block_hash``.

        Returns:
            False (and changes nothing) when caching is off, the block already has a hash, or
            another block is registered under the same hash (the first keeps it; this block
            stays unhashed and is plainly freed later).
        """
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        assert block.ref_count > 0, "only a block in use can be registered"
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every hash; cached free blocks become plain free blocks (ids in LRU order).

        For a stage that restarted with an empty KV pool. Returns how many hashes were dropped.
        Mutates: every hashed block, both free lists, the index. O(hashed blocks).
        """
        dropped = len(self._cached)
        while self._evictable:
            block = self._evictable.pop_oldest()
            block.block_hash = None
            self._free.append(block)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return dropped

    def _drop_hash(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        block.block_hash = None

    def check_integrity(self, expected_refs: Mapping[int, int]) -> None:
        """Verify every block is in exactly one state and its count matches ``expected_refs``.

        Args:
            expected_refs: block id -> number of block tables that hold it (absent means 0).

        Raises:
            IntegrityError: with the first inconsistency found.
        """
        try:
            evictable = self._evictable.check_links()
        except AssertionError as exc:
            raise IntegrityError(f"eviction queue: {exc}") from exc
        free_ids = {b.block_id for b in self._free}
        cached_free_ids = {b.block_id for b in evictable}
        if len(free_ids) != len(self._free) or len(cached_free_ids) != len(evictable):
            raise IntegrityError("a block appears twice in a free list")
        if free_ids & cached_free_ids:
            raise IntegrityError(f"blocks both free and cached free: {free_ids & cached_free_ids}")
        for block in self.blocks:
            self._check_block(block, expected_refs.get(block.block_id, 0),
                              block.block_id in free_ids, block.block_id in cached_free_ids)
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise IntegrityError(f"{block} indexed under a hash it does not carry")

    def _check_block(self, block: KVBlock, refs: int, is_free: bool, is_cached_free: bool) -> None:
        if block.ref_count != refs:
            raise IntegrityError(f"{block}: {refs} block tables hold it")
        hashed = block.block_hash is not None
        if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
            raise IntegrityError(f"{block} carries a hash the index does not map to it")
        state_ok = (
            (refs > 0 and not is_free and not is_cached_free)
            or (refs == 0 and not hashed and is_free and not is_cached_free)
            or (refs == 0 and hashed and is_cached_free and not is_free)
        )
        if not state_ok:
            raise IntegrityError(
                f"{block} in no single state (free={is_free}, cached_free={is_cached_free})"
            )
        if not is_cached_free and (block.prev is not None or block.next is not None):
            raise IntegrityError(f"{block} is linked but not in the eviction queue")
