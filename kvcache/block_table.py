"""``BlockTable``: the blocks of one sequence. Internal to ``kvcache``; callers see only the
``KVCacheManager``'s records and query methods."""

from __future__ import annotations

from kvcache.errors import IntegrityError
from kvcache.free_queue import KVBlock
from kvcache.hashing import BlockHash


class BlockTable:
    """The blocks of one sequence, in position order. Owned and mutated by ``KVCacheManager``.

    Slot ``p`` of the sequence is offset ``p % block_size`` of ``blocks[p // block_size]``.

    Attributes:
        seq_id: the sequence.
        blocks: the table; each block holds one reference from this table.
        cached_hashes: the hashes of the leading blocks already looked up in or offered to the
            prefix cache (prefix hits, blocks shared at a fork, blocks ``cache_full_blocks``
            registered or found registered already); the next ``cache_full_blocks`` starts at
            ``len(cached_hashes)``. Kept so ``check_integrity`` can tell a block holding other
            tokens' KV.
    """

    __slots__ = ("blocks", "cached_hashes", "seq_id")

    def __init__(self, seq_id: int, blocks: list[KVBlock], cached_hashes: list[BlockHash]) -> None:
        self.seq_id = seq_id
        self.blocks = blocks
        self.cached_hashes = cached_hashes

    @property
    def num_cached_blocks(self) -> int:
        """Leading blocks already looked up in or offered to the prefix cache."""
        return len(self.cached_hashes)

    def block_ids_from(self, start: int) -> tuple[int, ...]:
        """The ids of ``blocks[start:]``, in position order."""
        return tuple([block.block_id for block in self.blocks[start:]])

    def check_integrity(self, seq_id: int) -> None:
        """Verify the table is ``seq_id``'s, holds no block twice, and no block it offered to
        the prefix cache carries another hash. Raises IntegrityError."""
        ids = self.block_ids_from(0)
        if self.seq_id != seq_id or len(set(ids)) != len(ids):
            raise IntegrityError(f"table of {seq_id} is malformed: {self}")
        if self.num_cached_blocks > len(ids):
            raise IntegrityError(f"table of {seq_id}: more cached blocks than blocks")
        for index, block_hash in enumerate(self.cached_hashes):
            held = self.blocks[index].block_hash
            if held is not None and held != block_hash:
                raise IntegrityError(f"table of {seq_id}: block {index} holds other tokens' KV")

    def __repr__(self) -> str:
        return f"BlockTable(seq_id={self.seq_id}, block_ids={list(self.block_ids_from(0))})"
