"""The stage's physical paged KV pool: K and V for each of its layers, this rank's heads.

Block ids come from the router and are the same on every stage; each stage maps them into
its own pool. Layout per layer: [num_blocks, block_size, kv_heads_this_rank, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVPoolShape:
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block over all this stage's layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.head_dim * elem

    def blocks_that_fit(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block)


class KVPool:
    """Owns the cache tensors. `layer(i)` gives the (k, v) pair of local layer i."""

    def __init__(self, shape: KVPoolShape, device: torch.device) -> None:
        self.shape = shape
        # One allocation: [layers, 2, blocks, block_size, heads, head_dim].
        self.cache = torch.zeros(
            shape.num_layers, 2, shape.num_blocks, shape.block_size, shape.kv_heads,
            shape.head_dim, dtype=shape.dtype, device=device,
        )
        # Views made once: the model reads them every step.
        self._layers = [(self.cache[i, 0], self.cache[i, 1]) for i in range(shape.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[index]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._layers
