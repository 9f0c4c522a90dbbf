"""CUDA graphs of pure-decode steps: one per padded batch size, captured once at start-up.

A decode step launches a few kernels per layer on tiny tensors, so on a fast card its time
is the CPU launching them. A graph replays the whole stage's launches as one. Everything a
replay reads lives in static buffers filled before it: input ids (or hidden states), each
row's index into the stage's device block tables (`BlockTables`, updated before the replay
with only what changed) and the sequence lengths; the rows' block tables, positions, rope
tables and KV slots are computed from them inside the graph. A batch of n sequences runs
in the graph of the smallest bucket >= n; the padding rows read the tables' padding row and
decode position 0 of a scratch KV block no sequence owns.

Used on CUDA with the Triton attention kernel, at TP size 1 or over an NCCL group (the
row-parallel layers' all-reduces are captured; the warm-up passes before each capture run
them eagerly first, which creates the communicator); prefill and mixed steps, and decode
batches above the largest bucket or with longer block tables than the tables hold, run
eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import cache, partial
from typing import TypeVar

import torch

from kernels.paged_attention import PagedAttentionMetadata
from kernels.rotary import rope_cos_sin
from stage_worker.block_tables import BlockTables
from stage_worker.forward_context import ForwardContext
from stage_worker.host_transfer import upload
from stage_worker.model_runner import InputFill
from stage_worker.models.llama import LlamaStageModel
from stage_worker.step_input import SeqChunk

log = logging.getLogger("stagemesh.runner")

T = TypeVar("T")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_GRAPH_BATCH = BUCKETS[-1]


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The buckets captured for batches up to `max_batch`: every bucket below it and the
    smallest one that holds it (at most MAX_GRAPH_BATCH)."""
    below = tuple(b for b in BUCKETS if b < max_batch)
    return below + tuple(b for b in BUCKETS if b >= max_batch)[:1]


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream this process's captures on `device` warm up on. cuBLAS keeps a
    workspace for every stream it runs on, and torch hands out a different stream of its
    pool (up to 32) for each `torch.cuda.Stream()`: a stream per capture held a workspace
    per capture, memory the KV pool's sizing never saw."""
    return _stream_of(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _stream_of(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


def capture_graph(fn: Callable[[], T], pool: object, device: torch.device
            ) -> tuple[torch.cuda.CUDAGraph, T]:
    """`fn` run twice eagerly on the capture stream (Triton compiles, cuBLAS picks its
    kernels, an NCCL communicator is created), then captured into a graph drawing on
    `pool`; returns the graph and what the captured call returned (its output buffers)."""
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):  # type: ignore[arg-type]  # a pool handle
        out = fn()
    return graph, out


class DecodeGraphs:
    """Captured decode steps of one stage.

    Args:
        model: the stage's layers.
        kv_layers: the (k, v) cache pair of every local layer (the same tensors replayed).
        inv_freq: rope inverse frequencies [head_dim / 2].
        tables: the stage's block tables; their padding row must name a scratch KV block
            outside the pool the scheduler hands out.
        input_shape: () for token ids (first stage), (hidden,) for hidden states.
        dtype: hidden-state dtype (non-first stages).
        max_batch: the largest batch to replay (see `graph_buckets`).
    """

    def __init__(self, model: LlamaStageModel, kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 inv_freq: torch.Tensor, tables: BlockTables,
                 input_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 max_batch: int = MAX_GRAPH_BATCH) -> None:
        started = time.monotonic()
        self.model = model
        self.kv_layers = kv_layers
        self.inv_freq = inv_freq.to(device)
        self.tables = tables
        self.buckets = graph_buckets(max_batch)
        size = self.buckets[-1]
        self.inputs = (torch.zeros(size, dtype=torch.long, device=device) if not input_shape
                       else torch.zeros(size, *input_shape, dtype=dtype, device=device))
        self.table_rows = torch.full((size,), tables.padding_row, dtype=torch.int64,
                                     device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.query_start = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(size, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self.graphs[b], self.outputs[b] = capture_graph(partial(self._forward, b), pool,
                                                            device)
        torch.cuda.synchronize(device)
        log.info("captured decode graphs for batch sizes %s in %.1fs",
                 ",".join(map(str, self.buckets)), time.monotonic() - started)

    def _forward(self, b: int) -> torch.Tensor:
        """The captured step over the first `b` rows of the buffers."""
        block_size = self.tables.block_size
        seq_lens = self.seq_lens[:b]
        positions = seq_lens.long() - 1
        tables = self.tables.table[self.table_rows[:b]]  # [b, max_blocks]
        slots = (tables[self.rows[:b], positions // block_size].long() * block_size
                 + positions % block_size)
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        attn = PagedAttentionMetadata(
            block_tables=tables, seq_lens=seq_lens, query_start=self.query_start[:b + 1],
            seq_lens_host=(1,) * b, query_start_host=tuple(range(b + 1)), max_query_len=1,
            max_seq_len=self.tables.max_blocks * block_size)
        ctx = ForwardContext(positions, cos, sin, slots, attn)
        return self.model(self.inputs[:b], self.kv_layers, ctx)

    def covers(self, chunks: Sequence[SeqChunk]) -> bool:
        """Whether this step can replay a graph: all decodes, within the buffers."""
        return len(chunks) <= self.buckets[-1] and all(c.num_new == 1 for c in chunks)

    def run(self, chunks: Sequence[SeqChunk], inputs: torch.Tensor,
            fill: InputFill | None = None) -> torch.Tensor:
        """Replay for `chunks` (see `covers`); returns hidden states [n, H] (a view of the
        graph's output, valid until the next replay). `inputs` [n] or [n, H] on the device;
        `fill`, if given, writes late inputs into the graph's input rows [n] just before the
        replay (`ModelRunner.execute`).

        The table rows and lengths are staged on the host as one int64 array and uploaded
        without blocking; every other buffer update is a device-side copy or fill.
        Raises ValueError (from `BlockTables.rows_for`) for a block table that cannot hold
        its sequence.
        """
        n = len(chunks)
        b = next(size for size in self.buckets if size >= n)
        staged = self.tables.rows_for(chunks)
        staged.extend([c.num_computed + 1 for c in chunks])
        packed = upload(torch.frombuffer(staged, dtype=torch.int64), self.seq_lens.device)
        self.table_rows[:n].copy_(packed[:n])
        self.seq_lens[:n].copy_(packed[n:])
        self.inputs[:n].copy_(inputs)
        if n < b:  # padding rows: position 0 of the scratch block
            self.seq_lens[n:b].fill_(1)
            self.table_rows[n:b].fill_(self.tables.padding_row)
        if fill is not None:
            fill(self.inputs[:n])
        self.graphs[b].replay()
        return self.outputs[b][:n]
