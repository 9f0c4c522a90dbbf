"""The least-recently-used queue of cached free blocks: a doubly linked list.

A cached free block can leave the queue from anywhere (a new sequence hits it in the prefix
cache), so it is linked in place: append, pop-oldest and remove-from-the-middle are all O(1) and
allocate nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvcache.hashing import BlockHash


class KVBlock:
    """One logical block: an id shared by every stage, a reference count, an optional hash.

    States (exactly one holds; ``check_integrity`` verifies it):
      * in use: ``ref_count > 0``; in no free list.
      * free: ``ref_count == 0`` and ``block_hash is None``; in the pool's free deque.
      * cached free: ``ref_count == 0`` and a ``block_hash``; in the ``EvictionQueue``.

    ``prev``/``next`` are the links of the ``EvictionQueue`` and are None outside it.
    """

    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVBlock(id={self.block_id}, refs={self.ref_count}, hashed={hashed})"


class EvictionQueue:
    """Cached free blocks, least recently freed first (the next to evict is at the head).

    Two sentinel blocks (id -1) bound the list, so no operation tests for an empty neighbour.
    """

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        """Blocks from the least recently used to the most."""
        block = self._head.next
        while block is not self._tail:
            assert block is not None  # the tail sentinel ends every walk
            yield block
            block = block.next

    def append(self, block: KVBlock) -> None:
        """Link ``block`` (not in any list) as the most recently used one."""
        last = self._tail.prev
        assert last is not None
        block.prev, block.next = last, self._tail
        last.next = block
        self._tail.prev = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block``, which must be in this queue."""
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"{block} is not in the eviction queue"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._len -= 1

    def pop_oldest(self) -> KVBlock:
        """Unlink and return the least recently used block.

        Raises:
            IndexError: the queue is empty.
        """
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("pop from an empty EvictionQueue")
        self.remove(block)
        return block

    def check_links(self) -> list[KVBlock]:
        """Walk the list both ways and return its blocks; AssertionError if a link is broken."""
        forward = list(self)
        backward: list[KVBlock] = []
        block = self._tail.prev
        while block is not self._head:
            assert block is not None, "broken prev link"
            backward.append(block)
            block = block.prev
        assert forward == backward[::-1], "prev and next links disagree"
        assert len(forward) == self._len, f"length {self._len} but {len(forward)} linked blocks"
        return forward
