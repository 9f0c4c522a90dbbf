"""Build one TP rank's executor from a StageConfig: model, weights, KV pool (or fake)."""

from __future__ import annotations

import torch

from foundation.model_config import ModelConfig
from stage_worker.config import StageConfig
from stage_worker.executor import ComputeShape, StepExecutor
from stage_worker.offline import resolve_dtype
from stage_worker.parallel import TPGroup
from stage_worker.partition import partition_layers
from stage_worker.runner import StageRunner, StageRunnerConfig


def rank_device(cfg: StageConfig, tp_rank: int) -> torch.device:
    """cpu, or cuda:(N + tp_rank) for device cuda[:N]."""
    if cfg.device == "cpu":
        return torch.device("cpu")
    base = torch.device(cfg.device)
    return torch.device("cuda", (base.index or 0) + tp_rank)


def build_executor(cfg: StageConfig, tp: TPGroup) -> tuple[StepExecutor, ModelConfig]:
    model_cfg = ModelConfig.from_dir(cfg.model_dir)
    layers = partition_layers(model_cfg.num_layers, cfg.num_stages,
                              cfg.layer_override)[cfg.stage_index]
    device = rank_device(cfg, tp.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.fake_compute:
        shape = ComputeShape(layers, model_cfg.hidden_size, model_cfg.vocab_size, dtype, device)
        return StepExecutor(shape, None), model_cfg
    runner_cfg = StageRunnerConfig(cfg.model_dir, layers, dtype, device, cfg.block_size,
                                   cfg.num_blocks, cfg.kv_cache_bytes,
                                   cfg.gpu_memory_utilization,
                                   cuda_graphs=not cfg.enforce_eager)
    runner = StageRunner(runner_cfg, model_cfg, tp)
    return StepExecutor.for_runner(runner, model_cfg), model_cfg
