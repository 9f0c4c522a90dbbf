"""The tensor-parallel group a stage's layers shard over.

Every collective goes through `TPGroup`; at size 1 each call returns its input untouched, so
single-rank runs never touch torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """One stage's TP group: this rank's index, the group size, and the process group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    # A gloo group over the same ranks for host-side control traffic (plans), so a NCCL
    # device group never carries CPU bytes.
    control: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} outside group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a TP group of size > 1 needs a process group")

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can capture this group's collectives: none at size 1, NCCL's
        (which records them as graph nodes) otherwise; gloo's run on the host."""
        return self.size == 1 or (self.group is not None
                                  and dist.get_backend(self.group) == "nccl")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns it."""
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 passes `data`; every rank returns it. Length first, then the bytes."""
        if self.size == 1:
            assert data is not None
            return data
        group = self.control or self.group
        root = dist.get_global_rank(group, 0) if group is not None else 0
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=root, group=group)
        if self.rank == 0:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                torch.empty(0, dtype=torch.uint8)
        else:
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
        if buf.numel():
            dist.broadcast(buf, src=root, group=group)
        return data if data is not None else buf.numpy().tobytes()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank passes its own; all get it)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control or self.group)
        return int(t.item())

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy rank `src`'s `x` (group rank) into every rank's `x`, in place."""
        if self.size == 1 or self.group is None:
            return x
        dist.broadcast(x, src=dist.get_global_rank(self.group, src), group=self.group)
        return x


def init_tp_group(rank: int, size: int, init_method: str, backend: str,
                  timeout_s: float = 120.0) -> TPGroup:
    """Join this process to its stage's TP group.

    init_method: a torch.distributed rendezvous URL, e.g. "tcp://127.0.0.1:29501".
    backend: "gloo" or "nccl", as `kernels.platform.distributed_backend` gives for the
        stage's device. A NCCL group gets a gloo twin for host-side control traffic.
    """
    if size == 1:
        return TPGroup()
    from datetime import timedelta

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    world = dist.group.WORLD
    control = world if backend == "gloo" else dist.new_group(backend="gloo")
    return TPGroup(rank, size, world, control)


def shard_range(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """[start, end) of rank's equal shard of `total`; raises if it does not divide."""
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor parallel size {size}")
    per = total // size
    return rank * per, (rank + 1) * per


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one TP rank owns: query heads [q_start, q_end) and KV heads
    [kv_start, kv_end). Every local query head reads a local KV head, and each local KV head
    serves the same number of local query heads (so grouped attention stays uniform)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_q(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv(self) -> int:
        return self.kv_end - self.kv_start


def _even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous split of `total` into `parts` as even as possible (earlier parts larger)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard_heads(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """Assign heads to a TP rank.

    With at least as many KV heads as ranks, KV heads are split (unevenly if they must, e.g.
    3 KV heads over 2 ranks: 2 + 1) and each rank takes the query heads of its KV heads.
    With fewer KV heads than ranks, each KV head is replicated on `tp_size // num_kv_heads`
    ranks, which split that head's query group between them.

    Raises:
        ValueError: a layout where some rank would get no query head, or KV heads that do
            not divide the ranks evenly when replicated.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, kv_end = _even_split(num_kv_heads, tp_size, rank)
        return HeadShard(kv_start * group, kv_end * group, kv_start, kv_end)
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor parallel size {tp_size} must be a multiple of num_kv_heads "
                         f"{num_kv_heads} when it exceeds it")
    replicas = tp_size // num_kv_heads
    if group < replicas:
        raise ValueError(f"tensor parallel size {tp_size} exceeds the number of query heads "
                         f"per KV head ({group}) times KV heads ({num_kv_heads})")
    kv = rank // replicas
    q_start, q_end = _even_split(group, replicas, rank % replicas)
    return HeadShard(kv * group + q_start, kv * group + q_end, kv, kv + 1)
