"""Column-, row-, QKV- and merged-column-parallel linear layers.

Weights are stored [out_features_this_rank, in_features_this_rank] as in nn.Linear.
Column parallel: output features sharded, no communication. Row parallel: input features
sharded, partial sums all-reduced (bias added once, after the reduce).

`quantize_fp8()` (after loading) stores a layer's weight as float8_e4m3fn with one scale
per output feature (`kernels.fp8_linear`); its matmuls then run the fp8 kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_linear import quantize_weight
from kernels.linear import linear, linear_silu_and_mul
from stage_worker.layers.weights import WeightSource, copy_checked
from stage_worker.parallel import HeadShard, TPGroup, shard_range


class LinearLayer(nn.Module):
    """What every linear layer shares: its weight [out, in] and, once `quantize_fp8` ran,
    the weight in e4m3 with its per-output-feature scales."""

    weight: nn.Parameter
    fp8_scale: torch.Tensor | None = None  # [out] fp32, set by quantize_fp8

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, bias, self.fp8_scale)

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its e4m3 form (the original is freed)."""
        q, scale = quantize_weight(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.fp8_scale = scale


class ColumnParallelLinear(LinearLayer):
    """y[:, shard] = x @ W[shard].T (+ b[shard]). Output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.out_start, self.out_end = shard_range(out_features, tp.rank, tp.size, "out features")
        n = self.out_end - self.out_start
        self.weight = nn.Parameter(torch.empty(n, in_features, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def load(self, name: str, src: WeightSource, shard: str | int | None = None) -> None:
        param = self.weight if name.endswith("weight") else self.bias
        assert param is not None, f"{name}: layer has no bias"
        copy_checked(param, src[self.out_start:self.out_end], name)


class RowParallelLinear(LinearLayer):
    """y = all_reduce(x[:, shard] @ W[:, shard].T) (+ b). Input arrives sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype, in_range: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.tp = tp
        # in_range: an explicit (possibly uneven) input shard, e.g. following attention heads.
        self.in_start, self.in_end = in_range or shard_range(in_features, tp.rank, tp.size,
                                                              "in features")
        n = self.in_end - self.in_start
        self.weight = nn.Parameter(torch.empty(out_features, n, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._matmul(x))
        return y if self.bias is None else y + self.bias

    def load(self, name: str, src: WeightSource, shard: str | int | None = None) -> None:
        if name.endswith("bias"):
            assert self.bias is not None, f"{name}: layer has no bias"
            copy_checked(self.bias, src[:], name)
        else:
            copy_checked(self.weight, src[:, self.in_start:self.in_end], name)


class QKVParallelLinear(LinearLayer):
    """Fused q/k/v projection; output [q heads | k heads | v heads] of this rank's shard.

    Heads are assigned by `shard_heads`: KV heads split across ranks (unevenly when they
    must), or replicated when there are fewer KV heads than ranks.
    """

    def __init__(self, hidden: int, head_dim: int, heads: HeadShard, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        out = (heads.num_q + 2 * heads.num_kv) * head_dim
        self.weight = nn.Parameter(torch.empty(out, hidden, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False)
                     if bias else None)

    @property
    def q_size(self) -> int:
        return self.heads.num_q * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.heads.num_kv * self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def load(self, name: str, src: WeightSource, shard: str | int | None = None) -> None:
        d, h = self.head_dim, self.heads
        if shard == "q":
            rows, offset = (h.q_start * d, h.q_end * d), 0
        elif shard in ("k", "v"):
            rows = (h.kv_start * d, h.kv_end * d)
            offset = self.q_size + (0 if shard == "k" else self.kv_size)
        else:
            raise ValueError(f"{name}: QKV shard must be q, k or v, got {shard!r}")
        param = self.weight if name.endswith("weight") else self.bias
        assert param is not None, f"{name}: layer has no bias"
        n = rows[1] - rows[0]
        copy_checked(param[offset:offset + n], src[rows[0]:rows[1]], name)


class MergedColumnParallelLinear(LinearLayer):
    """Several column-parallel outputs fused into one matmul (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], tp: TPGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.shards = [shard_range(n, tp.rank, tp.size, "out features") for n in out_sizes]
        local = [end - start for start, end in self.shards]
        self.offsets = [sum(local[:i]) for i in range(len(local))]
        self.weight = nn.Parameter(torch.empty(sum(local), in_features, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate, up] projection: [T, local gate features], the
        SiLU-and-mul fused into the matmul where the kernels allow (`kernels.linear`)."""
        assert len(self.shards) == 2 and self.offsets[1] * 2 == self.weight.shape[0], \
            "silu_and_mul needs two outputs of one size"
        return linear_silu_and_mul(x, self.weight, self.fp8_scale)

    def load(self, name: str, src: WeightSource, shard: str | int | None = None) -> None:
        assert isinstance(shard, int), f"{name}: merged shard index required"
        start, end = self.shards[shard]
        offset = self.offsets[shard]
        copy_checked(self.weight[offset:offset + end - start], src[start:end], name)
