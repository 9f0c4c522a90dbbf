"""Configuration of the logical KV block pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape of the logical KV pool the router allocates from.

    Attributes:
        num_blocks: blocks in the pool. The router sets it to the minimum that every stage
            reported at connect, so a block id means the same slot range on every stage.
        block_size: tokens per block. Slot ``p`` of a sequence lives in block
            ``table[p // block_size]`` at offset ``p % block_size``.
        enable_prefix_caching: keep the hashes of full blocks so a later sequence with the same
            prefix reuses them instead of recomputing (and freed full blocks stay reusable until
            evicted, least recently used first).

    Raises:
        ValueError: from construction, when a field is out of range.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def num_slots(self) -> int:
        """Token slots in the whole pool."""
        return self.num_blocks * self.block_size
