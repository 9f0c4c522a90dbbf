"""Offline generation: every stage of a pipeline in one process, no services.

This drives the runtime directly (the `stagemesh generate` command, tests, and runtime
benchmarks). Serving goes through the router and stage services instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from foundation.model_config import ModelConfig
from foundation.sampling_params import SamplingParams
from kernels import platform
from stage_worker.parallel import TPGroup
from stage_worker.partition import partition_layers
from stage_worker.runner import StageRunner, StageRunnerConfig
from stage_worker.sampling import Sampler, SamplingBatch
from stage_worker.step_input import SeqChunk

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`kernels.platform.resolve_device` for a command's --device flag: a device this
    machine lacks ends the command with a one-line message (SystemExit)."""
    try:
        return platform.resolve_device(name)
    except platform.DeviceUnavailableError as e:
        raise SystemExit(f"--device {e}") from None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on GPU, fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass(frozen=True)
class LocalPipelineConfig:
    model_dir: Path
    num_stages: int = 1
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")  # noqa: RUF009 (immutable)
    block_size: int = 16
    num_blocks: int = 256
    layer_override: tuple[int, ...] | None = None
    quantization: str = "none"  # or "fp8" (`StageRunnerConfig.quantization`)
    kv_cache_dtype: str = "auto"  # or "fp8" (`StageRunnerConfig.kv_cache_dtype`)


class LocalPipeline:
    """The stages of one pipeline chained in-process: ids -> stage 0 -> ... -> logits."""

    def __init__(self, cfg: LocalPipelineConfig, tp: TPGroup | None = None) -> None:
        """`tp`: this process's TP group, shared by its stages (every rank runs the same
        steps; logits are gathered so each rank sees all of them)."""
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_dir(cfg.model_dir)
        ranges = partition_layers(self.model_cfg.num_layers, cfg.num_stages, cfg.layer_override)
        self.stages = [
            StageRunner(StageRunnerConfig(cfg.model_dir, r, cfg.dtype, cfg.device,
                                          cfg.block_size, cfg.num_blocks,
                                          quantization=cfg.quantization,
                                          kv_cache_dtype=cfg.kv_cache_dtype),
                        self.model_cfg, tp)
            for r in ranges
        ]

    def step(self, chunks: Sequence[SeqChunk], token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] -> logits [S_sampling, V] (fp32)."""
        x = token_ids
        for stage in self.stages:
            x = stage.execute(chunks, x)
        return x


def generate(pipe: LocalPipeline, prompts: Sequence[Sequence[int]],
             params: Sequence[SamplingParams], max_new_tokens: int,
             stop_ids: Sequence[int] = ()) -> list[list[int]]:
    """Batched generation: one mixed prefill step, then batched decode steps, sampled on
    tensors by the last stage's `Sampler`.

    Blocks are handed out contiguously per sequence, sized for prompt + max_new_tokens.
    Returns the generated ids per prompt (a stop id ends a sequence and is included).
    """
    block = pipe.cfg.block_size
    tables, next_block = [], 0
    for p in prompts:
        n = -(-(len(p) + max_new_tokens) // block)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    if next_block > pipe.cfg.num_blocks:
        raise ValueError(f"need {next_block} KV blocks, pool has {pipe.cfg.num_blocks}")
    sampler = Sampler()
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    chunks = [SeqChunk(i, 0, len(p), tables[i]) for i, p in enumerate(prompts)]
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    while live:
        logits = pipe.step(chunks, ids)
        batch = SamplingBatch.build([params[i] for i in live], [prompts[i] for i in live],
                                    [outputs[i] for i in live], [len(outputs[i]) for i in live],
                                    pipe.model_cfg.vocab_size, logits.device)
        next_ids = sampler(logits, batch).token_ids.tolist()
        still = []
        for i, tok in zip(live, next_ids, strict=True):
            outputs[i].append(tok)
            if tok not in stop_ids and len(outputs[i]) < max_new_tokens:
                still.append(i)
        live = still
        chunks = [SeqChunk(i, len(prompts[i]) + len(outputs[i]) - 1, 1, tables[i]) for i in live]
        ids = torch.tensor([outputs[i][-1] for i in live], dtype=torch.long)
    return outputs


def greedy_generate(pipe: LocalPipeline, prompts: Sequence[Sequence[int]],
                    max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[list[int]]:
    """`generate` with temperature 0 for every prompt."""
    greedy = [SamplingParams(temperature=0.0)] * len(prompts)
    return generate(pipe, prompts, greedy, max_new_tokens, stop_ids)

