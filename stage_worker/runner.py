"""The torch model runner: builds this stage's layers, loads their weights, owns the KV pool
and every device call, executes one step at a time, and samples on the last stage."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from foundation.model_config import ModelConfig
from kernels.argmax import argmax_rows
from kernels.attention_launch import PREFILL_LAUNCH
from kernels.fp8_format import FP8
from kernels.paged_attention import uses_triton_kernel
from kernels.platform import PLATFORM
from kernels.rotary import rope_inv_freq
from stage_worker.block_tables import BlockTables
from stage_worker.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs
from stage_worker.held_seqs import HeldSeq
from stage_worker.host_transfer import to_device, upload
from stage_worker.kv_pool import KVPool, KVPoolShape
from stage_worker.loader import load_stage_weights, load_stage_weights_from_tensors
from stage_worker.mixed_graphs import MixedGraphs
from stage_worker.model_runner import InputFill, ModelRunner, StageCapacity, StageShape
from stage_worker.models.llama import LlamaStageModel
from stage_worker.parallel import TPGroup, shard_heads
from stage_worker.partition import LayerRange
from stage_worker.sampling import Sampler
from stage_worker.step_input import SeqChunk, build_context, score_rows
from stage_worker.step_sampling import StepSample, sample_step
from stage_worker.structured import GrammarMasks

log = logging.getLogger("stagemesh.runner")

CPU_DEFAULT_KV_BYTES = 512 << 20


@dataclass(frozen=True)
class StageRunnerConfig:
    """How to build one stage on one TP rank.

    num_blocks fixes the pool size (tests); otherwise the pool takes `kv_cache_bytes`, or on
    CUDA `gpu_memory_utilization` of the card minus weights and the activation peak of a
    profiled step of `max_num_batched_tokens` tokens over `max_num_seqs` sequences.
    max_held_seqs: the sequences whose block tables stay on the device between steps (the
    router runs at most `max_num_seqs` per pipeline stage; more only costs rewrites, see
    `stage_worker.block_tables`); default `max_num_seqs`.
    cuda_graphs: capture decode steps (see `stage_worker.cuda_graphs`) for batches up to
    `max_num_seqs` (at most MAX_GRAPH_BATCH; larger ones run eagerly); off = always eager.
    quantization: "none" or "fp8" (the projections' weights in e4m3 once loaded, before the
    pool is sized: `LlamaStageModel.quantize_fp8`).
    kv_cache_dtype: "auto" (the pool in `dtype`) or "fp8" (e4m3 at unit scale: half the
    bytes per block, so twice the blocks in the same memory, and half the bytes a decode
    step's attention reads; see `kernels.paged_attention`).
    """

    model_dir: Path
    layers: LayerRange
    dtype: torch.dtype
    device: torch.device
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_held_seqs: int | None = None
    cuda_graphs: bool = True  # decode steps replay CUDA graphs where supported
    quantization: str = "none"
    kv_cache_dtype: str = "auto"

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the KV pool stores."""
        return FP8 if self.kv_cache_dtype == "fp8" else self.dtype


class StageRunner(ModelRunner):
    """Runs this stage's slice of a Llama-family model over a paged KV pool."""

    impl = "llama"

    def __init__(self, cfg: StageRunnerConfig, model_cfg: ModelConfig,
                 tp: TPGroup | None = None,
                 weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """`weights`: tensors in memory under checkpoint names, instead of reading
        `cfg.model_dir` (benchmarks sharing one random model with a reference)."""
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.tp = tp or TPGroup()
        self.sampler = Sampler()
        self.grammars = (GrammarMasks(cfg.model_dir, model_cfg.vocab_size)
                         if cfg.layers.is_last else None)
        started = time.monotonic()
        with torch.device(cfg.device):
            self.model = LlamaStageModel(model_cfg, cfg.layers, self.tp, cfg.dtype)
        if weights is None:
            load_stage_weights(self.model, cfg.model_dir, model_cfg.tie_word_embeddings)
        else:
            load_stage_weights_from_tensors(self.model, weights, model_cfg.tie_word_embeddings)
        self.model.eval()
        if cfg.quantization == "fp8":
            self.model.quantize_fp8()
            if cfg.device.type == "cuda":
                torch.cuda.empty_cache()  # the bf16 weights' memory, for the pool's sizing
        scaling = model_cfg.rope_scaling
        self.inv_freq = rope_inv_freq(  # on the device: each step's rope is computed there
            model_cfg.head_dim, model_cfg.rope_theta,
            None if scaling is None else (scaling.factor, scaling.low_freq_factor,
                                          scaling.high_freq_factor,
                                          scaling.original_max_position_embeddings),
        ).to(cfg.device)
        heads = shard_heads(model_cfg.num_heads, model_cfg.num_kv_heads, self.tp.size,
                            self.tp.rank)
        self._pool_shape = KVPoolShape(len(cfg.layers), 0, cfg.block_size, heads.num_kv,
                                       model_cfg.head_dim, cfg.kv_dtype)
        self.graphs: DecodeGraphs | None = None  # captured below, after the pool exists
        self.mixed_graphs: MixedGraphs | None = None
        self.use_graphs = False
        num_blocks = cfg.num_blocks if cfg.num_blocks is not None else self._blocks_that_fit()
        self._num_blocks = num_blocks
        graphs = self._graphs_supported()
        # With graphs, one block more than announced: the padding rows' scratch block.
        self.kv = KVPool(
            KVPoolShape(len(cfg.layers), num_blocks + int(graphs), cfg.block_size,
                        heads.num_kv, model_cfg.head_dim, cfg.kv_dtype),
            cfg.device,
        )
        # The tables the steps use: ids checked against the pool; with graphs, the padding
        # row reads the scratch block.
        self.tables = self._step_tables(num_blocks if graphs else -1, num_blocks)
        if graphs:
            self.graphs = self._capture_graphs()
            if len(cfg.layers):
                self.mixed_graphs = self._capture_mixed_graphs(num_blocks * cfg.block_size)
        if cfg.device.type == "cuda" and PLATFORM.use_triton:  # norms, rope, SiLU: Triton
            self._warm_up(num_blocks)
        self.use_graphs = self.graphs is not None
        log.info("stage layers %d-%d ready in %.1fs: %d KV blocks of %d tokens (%s)",
                 cfg.layers.start, cfg.layers.end - 1, time.monotonic() - started,
                 num_blocks, cfg.block_size, str(cfg.kv_dtype).removeprefix("torch."))

    @property
    def _table_blocks(self) -> int:
        """The widest block table: the model's longest context, in blocks."""
        return -(-self.model_cfg.max_position_embeddings // self.cfg.block_size)

    def _step_tables(self, fill: int, num_blocks: int) -> BlockTables:
        """The steps' block tables over a pool of `num_blocks` (ids checked against it): a
        row for every sequence a stage holds at once; `fill` in the entries no sequence
        wrote and the padding row (with graphs, the scratch block; else -1)."""
        cfg = self.cfg
        return BlockTables(max(cfg.max_held_seqs or 0, cfg.max_num_seqs), self._table_blocks,
                           cfg.block_size, cfg.device, fill=fill, num_blocks=num_blocks)

    @property
    def num_blocks(self) -> int:
        """KV blocks the scheduler may hand out (the scratch block is not among them)."""
        return self._num_blocks

    @property
    def shape(self) -> StageShape:
        m = self.model_cfg
        return StageShape(self.cfg.layers, m.hidden_size, m.vocab_size, self.cfg.dtype,
                          self.cfg.device)

    @property
    def capacity(self) -> StageCapacity:
        return StageCapacity(self._num_blocks, self.cfg.block_size,
                             self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs)

    @torch.inference_mode()
    def _capture_graphs(self) -> DecodeGraphs:
        """Decode graphs for batches up to max_num_seqs (at most MAX_GRAPH_BATCH)."""
        cfg, model_cfg = self.cfg, self.model_cfg
        return DecodeGraphs(
            self.model, self.kv.layers(), self.inv_freq, self.tables,
            input_shape=() if self.is_first else (model_cfg.hidden_size,),
            dtype=cfg.dtype, device=cfg.device, max_batch=min(cfg.max_num_seqs, MAX_GRAPH_BATCH))

    @torch.inference_mode()
    def _capture_mixed_graphs(self, scratch_slot: int) -> MixedGraphs:
        """Piecewise graphs of prefill and mixed steps (`scratch_slot`, the scratch block's
        first slot, takes the padding rows' K/V)."""
        cfg, model_cfg = self.cfg, self.model_cfg
        return MixedGraphs(
            self.model, self.kv.layers(), scratch_slot=scratch_slot,
            input_shape=() if self.is_first else (model_cfg.hidden_size,), dtype=cfg.dtype,
            device=cfg.device, max_tokens=cfg.max_num_batched_tokens,
            head_dim=model_cfg.head_dim)

    @torch.inference_mode()
    def _warm_up(self, num_blocks: int, what: str = "warmed up") -> None:
        """Run the eager step shapes once (and, on the last stage, the greedy sampler's argmax
        on their logits), so every kernel variant a step can launch is
        compiled (or loaded from Triton's cache) before the first request: a variant first
        met while serving stalls that step for the compile, half a second a kernel. The
        steps write garbage into KV blocks [0, num_blocks) no sequence owns yet; their table
        rows are dropped afterwards. Collective under TP (every rank runs the same steps)."""
        started = time.monotonic()
        longest = min(self.cfg.max_num_batched_tokens, self.tables.max_blocks * self.cfg.block_size)
        chunks_list = warm_up_chunks(longest, self.cfg.max_num_seqs,
                                     self.model_cfg.num_heads // self.model_cfg.num_kv_heads,
                                     self.cfg.block_size, num_blocks, PREFILL_LAUNCH.block_m)
        assert not self.use_graphs, "warm-up steps run eagerly, decodes too"
        try:
            for chunks in chunks_list:
                tokens = sum(c.num_new for c in chunks)
                dummy = (torch.zeros(tokens, dtype=torch.long) if self.is_first else
                         torch.zeros(tokens, self.model_cfg.hidden_size, dtype=self.cfg.dtype))
                out = self.execute(chunks, dummy)
                if self.is_last:  # the greedy sampler's kernel, on the logits it will get
                    argmax_rows(out)
            torch.cuda.synchronize(self.cfg.device)
        finally:
            self.tables.clear()
        log.info("%s %d step shapes in %.1fs", what, len(chunks_list),
                 time.monotonic() - started)

    def _graphs_supported(self) -> bool:
        # Graphs capture the Triton attention (the reference's shapes depend on the batch)
        # and, at TP > 1, the layers' NCCL all-reduces: every rank captures the same
        # buckets in the same order at start-up and replays the same one for a step (its
        # plan is the same on every rank), so the captured collectives pair up.
        return (self.cfg.cuda_graphs and self.tp.capturable
                and uses_triton_kernel(self.cfg.device, self.cfg.block_size,
                                       self.model_cfg.head_dim))

    @property
    def is_first(self) -> bool:
        return self.cfg.layers.is_first

    @property
    def is_last(self) -> bool:
        return self.cfg.layers.is_last

    @torch.inference_mode()
    def execute(self, chunks: Sequence[SeqChunk], inputs: torch.Tensor,
                fill: InputFill | None = None) -> torch.Tensor:
        """Run one step.

        inputs: token ids [T] (int64) on the first stage, hidden states [T, H] elsewhere, T
        being the sum of the chunks' num_new, in chunk order.
        fill: first stage, see `ModelRunner.execute`: called after the host work (block
        tables, layout, uploads) and before the step's first kernel.
        Returns hidden states [T, H] on a non-last stage; on the last stage, fp32 logits
        [S + P, V]: the S chunks with `sample` set (their last rows), then the P prompt rows
        of chunks with `prompt_rows` (see `step_input.score_rows`).
        """
        device = self.cfg.device
        inputs = upload(inputs, device)  # a no-op for inputs already there
        if self.graphs is not None and self.use_graphs and self.graphs.covers(chunks):
            hidden = self.graphs.run(chunks, inputs, fill)
        else:
            ctx = build_context(chunks, self.tables, self.inv_freq, device)
            if fill is not None:
                fill(inputs)
            if self.mixed_graphs is not None and self.use_graphs \
                    and self.mixed_graphs.covers(chunks):
                hidden = self.mixed_graphs.run(inputs, ctx)
            else:
                hidden = self.model(inputs, self.kv.layers(), ctx)
        if not self.is_last:
            return hidden
        rows, num_prompt = score_rows(chunks)
        if num_prompt or len(rows) < hidden.shape[0]:  # not the rows in order, one each
            hidden = hidden[to_device(rows, torch.int64, device)]
        return self.model.compute_logits(hidden)

    def sample(self, seqs: Sequence[HeldSeq], scores: torch.Tensor) -> StepSample:
        """`scores`: the fp32 logits [S, V] `execute` returned; see `step_sampling`."""
        return sample_step(self.sampler, scores, seqs, self.model_cfg.vocab_size, self.grammars)

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy KV block src -> dst in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        src, dst = to_device(list(zip(*pairs, strict=True)), torch.int64, self.cfg.device)
        # cache: [layers, 2, blocks, ...]; one gather/scatter over all layers at once, on the
        # bytes (any pool dtype, fp8 included).
        raw = self.kv.cache.view(torch.uint8)
        raw[:, :, dst] = raw[:, :, src]

    def _blocks_that_fit(self) -> int:
        if self.cfg.kv_cache_bytes is not None:
            return self._pool_shape.blocks_that_fit(self.cfg.kv_cache_bytes)
        if self.cfg.device.type != "cuda":
            return self._pool_shape.blocks_that_fit(CPU_DEFAULT_KV_BYTES)
        return self._profile_cuda()

    def _profile_cuda(self) -> int:
        """Run the step shapes a stage runs eagerly over a scratch pool (the largest step,
        every sequence sampling, then the warm-up's: the allocator keeps what the largest
        of them took), and capture the step graphs over it (then drop them); the KV pool
        gets what is left under `gpu_memory_utilization` after weights, the allocator's
        peak over those steps and the graphs' memory."""
        cfg = self.cfg
        tokens = cfg.max_num_batched_tokens
        chunks = profile_chunks(tokens, cfg.max_num_seqs, cfg.block_size)
        blocks = max(max(c.block_table) for c in chunks) + 2  # the last: the graphs' scratch
        shape = self._pool_shape
        # The profiled steps' own tables, wide enough for the warm-up's longest sequence;
        # the steps' tables are built once the pool exists.
        width = min(self._table_blocks, max(max(len(c.block_table) for c in chunks),
                                            -(-tokens // cfg.block_size)))
        self.tables = BlockTables(max(len(chunks), cfg.max_num_seqs), width, shape.block_size,
                                  cfg.device)
        self.kv = KVPool(KVPoolShape(shape.num_layers, blocks, shape.block_size, shape.kv_heads,
                                     shape.head_dim, shape.dtype), cfg.device)
        torch.cuda.reset_peak_memory_stats(cfg.device)
        dummy = (torch.zeros(tokens, dtype=torch.long) if self.is_first else
                 torch.zeros(tokens, self.model_cfg.hidden_size, dtype=cfg.dtype))
        self.execute(chunks, dummy)
        if PLATFORM.use_triton:  # the shapes the warm-up runs once the pool exists
            self._warm_up(blocks - 1, "profiled")
        torch.cuda.synchronize(cfg.device)
        # Weights and activations, as the allocator holds them on the card (with its slack).
        peak = torch.cuda.max_memory_reserved(cfg.device)
        graphs = self._graphs_bytes(blocks - 1) if self._graphs_supported() else 0
        del self.kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(cfg.device)
        # This process's share of the card (stages sharing a GPU split it), minus what it
        # needs besides the pool; never more than is free now (other processes).
        budget = min(int(total * cfg.gpu_memory_utilization) - peak - graphs,
                     free - (1 << 30))
        log.info("profile: peak %.2f GiB over %d tokens, step graphs %.2f GiB; KV budget "
                 "%.2f GiB", peak / 2**30, tokens, graphs / 2**30, budget / 2**30)
        return shape.blocks_that_fit(budget)

    def _graphs_bytes(self, scratch_block: int) -> int:
        """The device memory this stage's step graphs hold (their memory pools, static
        buffers and tables, the capture stream's cuBLAS workspace): captured over the
        profile's pool, `scratch_block` as their padding rows' block, measured, dropped.
        Captured after the pool is sized, they would take memory it had counted as its own
        (stages sharing a card went over the card by theirs together)."""
        device = self.cfg.device
        torch.cuda.synchronize(device)
        # A capture empties the allocator's cache (`torch.cuda.graph`): empty it first, or the
        # profiled steps' cached blocks it frees come off the graphs' measure.
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        self.tables = self._step_tables(scratch_block, scratch_block)
        decode = self._capture_graphs()
        mixed = (self._capture_mixed_graphs(scratch_block * self.cfg.block_size)
                 if len(self.cfg.layers) else None)
        torch.cuda.synchronize(device)
        used = torch.cuda.memory_reserved(device) - before
        del decode, mixed  # the constructor builds the steps' tables after the pool
        return used


def profile_chunks(tokens: int, max_seqs: int, block_size: int) -> list[SeqChunk]:
    """The profiled step: `tokens` prefill tokens split over min(max_seqs, tokens)
    sequences, every one sampling (the largest activations and the most logit rows one step
    may have), with contiguous block tables from block 0."""
    n = max(1, min(max_seqs, tokens))
    base, extra = divmod(tokens, n)
    chunks, next_block = [], 0
    for i in range(n):
        length = base + int(i < extra)
        blocks = -(-length // block_size)
        chunks.append(SeqChunk(i, 0, length, range(next_block, next_block + blocks)))
        next_block += blocks
    return chunks


def warm_up_chunks(max_tokens: int, max_seqs: int, group: int, block_size: int,
                   num_blocks: int, tile_rows: int) -> list[list[SeqChunk]]:
    """The steps `StageRunner._warm_up` runs: query lengths on both sides of the attention
    launch's switch (a decode, a short chunk, the longest query of the decode launch, those
    whose rows just reach a prefill tile, a full prefill), each over one sequence (few
    programs: the key ranges split) and over as many as the step allows (no split), and a
    mixed step. `group`: query heads per KV head; `tile_rows`: the query rows from which the
    prefill launch is used. Every sequence reads the same blocks from 0 (the KV values do
    not matter); shapes the pool cannot hold are left out."""
    # A query of q tokens has q x group rows.
    first_prefill = -(-tile_rows // group)  # the shortest query of the prefill launch
    lengths = sorted({1, 2, max(1, first_prefill - 1), max(1, tile_rows // group),
                      first_prefill, max_tokens})
    steps: list[list[SeqChunk]] = []
    for q in (q for q in lengths if q <= max_tokens):
        for seqs in sorted({1, max(1, min(max_seqs, max_tokens // q))}):
            computed = 2 * block_size - 1 if q == 1 else 0  # a decode reads a few blocks
            blocks = range(-(-(computed + q) // block_size))
            if len(blocks) <= num_blocks:
                steps.append([SeqChunk(i, computed, q, blocks) for i in range(seqs)])
    short = min(max_tokens - 1, tile_rows)
    if short >= 1 and -(-(2 * block_size + short) // block_size) <= num_blocks:
        steps.append([SeqChunk(0, 2 * block_size - 1, 1, range(2)),
                      SeqChunk(1, block_size, short, range(-(-(block_size + short)
                                                            // block_size)))])
    return steps
