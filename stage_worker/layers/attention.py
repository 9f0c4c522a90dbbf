"""Self-attention over the stage's paged KV cache, tensor-parallel over heads."""

from __future__ import annotations

import torch
from torch import nn

from kernels.paged_attention import paged_attention
from kernels.rope_kv import rope_and_write_kv, rope_kv_decode_attention
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
        return self.o_proj(self.project_and_attend(x, kv_cache, ctx))

    def project_and_attend(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                           ctx: ForwardContext) -> torch.Tensor:
        """x [T, H] -> the heads' outputs [T, heads * head_dim], before o_proj: `attend` of
        `project`. A pure decode step does rope, the K/V write and attention in one launch
        where the kernel allows it (`kernels.rope_kv.rope_kv_decode_attention`)."""
        if ctx.attn is None or not ctx.attn.is_pure_decode:
            return self.attend(self.project(x, kv_cache, ctx), kv_cache, ctx)
        q, k, v = self._split_heads(self.qkv_proj(x))
        out = rope_kv_decode_attention(q, k, v, ctx.cos, ctx.sin, kv_cache[0], kv_cache[1],
                                       ctx.slot_mapping, ctx.attn, self.scale)
        return out.reshape(x.shape[0], -1)

    def _split_heads(self, qkv: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (heads + 2 kv_heads) * head_dim] -> views q [T, heads, head_dim],
        k and v [T, kv_heads, head_dim]."""
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        t, d = qkv.shape[0], self.head_dim
        return (qkv[:, :q_size].view(t, -1, d), qkv[:, q_size:q_size + kv_size].view(t, -1, d),
                qkv[:, q_size + kv_size:].view(t, -1, d))

    def project(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        """x [T, H] -> q [T, heads, head_dim] with rope applied; this step's K/V (roped) are
        written to their slots. Reads only ctx's cos, sin and slot_mapping."""
        q, k, v = self._split_heads(self.qkv_proj(x))
        k_cache, v_cache = kv_cache
        return rope_and_write_kv(q, k, v, ctx.cos, ctx.sin, k_cache, v_cache, ctx.slot_mapping)

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               ctx: ForwardContext) -> torch.Tensor:
        """q [T, heads, head_dim] -> the heads' outputs [T, heads * head_dim], before o_proj."""
        assert ctx.attn is not None, "attention needs the step's layout"
        out = paged_attention(q, kv_cache[0], kv_cache[1], ctx.attn, self.scale)
        return out.reshape(q.shape[0], -1)
