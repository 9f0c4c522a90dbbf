"""Self-attention over the stage's paged KV cache, tensor-parallel over heads."""

from __future__ import annotations

import torch
from torch import nn

from kernels.paged_attention import paged_attention
from kernels.rope_kv import rope_and_write_kv
from stage_worker.forward_context import ForwardContext
from stage_worker.layers.linear import QKVParallelLinear, RowParallelLinear
from stage_worker.parallel import TPGroup, shard_heads


class PagedSelfAttention(nn.Module):
    """x [T, H] -> [T, H]: QKV (column parallel), rope, write K/V to the pool, attend,
    output projection (row parallel, all-reduced)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        heads = shard_heads(num_heads, num_kv_heads, tp.size, tp.rank)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, False, tp, dtype,
                                        in_range=(heads.q_start * head_dim,
                                                  heads.q_end * head_dim))
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        return self.o_proj(self.attend(self.project(x, kv_cache, ctx), kv_cache, ctx))

    def project(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        """x [T, H] -> q [T, heads, head_dim] with rope applied; this step's K/V (roped) are
        written to their slots. Reads only ctx's cos, sin and slot_mapping."""
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        t, d = x.shape[0], self.head_dim
        q = qkv[:, :q_size].view(t, -1, d)
        k = qkv[:, q_size:q_size + kv_size].view(t, -1, d)
        v = qkv[:, q_size + kv_size:].view(t, -1, d)
        k_cache, v_cache = kv_cache
        return rope_and_write_kv(q, k, v, ctx.cos, ctx.sin, k_cache, v_cache, ctx.slot_mapping)

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               ctx: ForwardContext) -> torch.Tensor:
        """q [T, heads, head_dim] -> the heads' outputs [T, heads * head_dim], before o_proj."""
        assert ctx.attn is not None, "attention needs the step's layout"
        out = paged_attention(q, kv_cache[0], kv_cache[1], ctx.attn, self.scale)
        return out.reshape(q.shape[0], -1)
