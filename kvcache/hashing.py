"""Chained content hashes of full KV blocks, the keys of the prefix cache.

The hash of block ``i`` covers the hash of block ``i - 1``, the block's own token ids and an
optional extra key (for inputs that change the KV but not the token ids: a LoRA adapter, image
features...). Equal hashes therefore mean equal whole prefixes, so a hit on block ``i`` is valid
only if every earlier block also hit; lookups stop at the first miss.

SHA-256 rather than Python's ``hash()``: a 64-bit non-cryptographic hash lets a client craft a
prompt that collides with another user's prefix and reads attention over their KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""SHA-256 digest (32 bytes) of one full block and, through its parent, of the whole prefix."""

_ROOT_PARENT = b"\x00" * 32  # parent of block 0; no SHA-256 digest is all zeros in practice
_EXTRA_MARK = b"\x01"  # sets the extra key apart from the (fixed-length) token bytes


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes | None = None
) -> BlockHash:
    """Hash one full block.

    Args:
        parent: hash of the previous block of the same sequence, None for block 0.
        token_ids: the block's token ids (exactly ``block_size`` of them for a full block).
        extra_key: bytes that distinguish KV computed from the same tokens differently.

    Returns:
        The block's chained hash.

    Raises:
        OverflowError: a token id does not fit in a signed 64-bit integer.
    """
    digest = hashlib.sha256(parent if parent is not None else _ROOT_PARENT)
    digest.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        digest.update(_EXTRA_MARK)
        digest.update(extra_key)
    return BlockHash(digest.digest())


class BlockHashChain:
    """The hashes of a token sequence's full blocks, computed lazily and kept.

    A sequence's token history only grows (prompt, then generated tokens, also across a
    preemption), so ``hashes[i]`` stays valid for the sequence's whole life and is never
    recomputed. Invariant: ``hashes[i]`` covers tokens ``[0, (i + 1) * block_size)``.
    """

    __slots__ = ("block_size", "extra_key", "hashes")

    def __init__(self, block_size: int, extra_key: bytes | None = None) -> None:
        """Start an empty chain.

        Args:
            block_size: tokens per block (the pool's).
            extra_key: mixed into every block hash; see ``hash_block``.
        """
        self.block_size = block_size
        self.extra_key = extra_key
        self.hashes: list[BlockHash] = []

    def extend(self, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash every full block within ``token_ids[:num_tokens]`` not hashed yet.

        Args:
            token_ids: the sequence's whole history (at least ``num_tokens`` long).
            num_tokens: how many leading tokens are final and may be hashed.

        Mutates: appends to ``hashes``.
        """
        size = self.block_size
        for index in range(len(self.hashes), num_tokens // size):
            self.extend_one(token_ids[index * size : (index + 1) * size])

    def extend_one(self, block_token_ids: Sequence[int]) -> BlockHash:
        """Append the hash of the next block, given its ``block_size`` token ids, and return it."""
        parent = self.hashes[-1] if self.hashes else None
        block_hash = hash_block(parent, block_token_ids, self.extra_key)
        self.hashes.append(block_hash)
        return block_hash

    def copy(self) -> BlockHashChain:
        """An independent chain with the same hashes (for a forked sequence)."""
        twin = BlockHashChain(self.block_size, self.extra_key)
        twin.hashes = list(self.hashes)
        return twin
