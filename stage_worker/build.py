"""Build one TP rank of a stage from a StageConfig. The one place that picks the model
implementation (`StageConfig.model_impl`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from foundation.model_config import ModelConfig
from kernels.platform import resolve_device
from stage_worker.config import StageConfig
from stage_worker.model_runner import ModelRunner, StageCapacity, StageShape
from stage_worker.null_runner import NULL_NUM_BLOCKS, NullRunner
from stage_worker.offline import resolve_dtype
from stage_worker.parallel import TPGroup
from stage_worker.partition import LayerRange, partition_layers
from stage_worker.runner import StageRunner, StageRunnerConfig
from stage_worker.stage_rank import StageRank

RunnerFactory = Callable[[StageConfig, ModelConfig, StageShape, TPGroup], ModelRunner]


def rank_device(cfg: StageConfig, tp_rank: int) -> torch.device:
    """cpu, or cuda:(N + tp_rank) for device cuda[:N]. Raises DeviceUnavailableError for a
    device this machine lacks."""
    base = resolve_device(cfg.device)
    if base.type == "cpu":
        return base
    return torch.device("cuda", (base.index or 0) + tp_rank)


def _llama(cfg: StageConfig, model_cfg: ModelConfig, shape: StageShape,
           tp: TPGroup) -> ModelRunner:
    runner_cfg = StageRunnerConfig(
        cfg.model_dir, shape.layers, shape.dtype, shape.device, cfg.block_size, cfg.num_blocks,
        cfg.kv_cache_bytes, cfg.gpu_memory_utilization,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        max_held_seqs=cfg.max_num_seqs * cfg.num_stages, cuda_graphs=not cfg.enforce_eager,
        quantization=cfg.quantization, kv_cache_dtype=cfg.kv_cache_dtype)
    return StageRunner(runner_cfg, model_cfg, tp)


def _null(cfg: StageConfig, model_cfg: ModelConfig, shape: StageShape,
          tp: TPGroup) -> ModelRunner:
    return NullRunner(shape, StageCapacity(cfg.num_blocks or NULL_NUM_BLOCKS, cfg.block_size,
                                           cfg.max_num_batched_tokens, cfg.max_num_seqs))


# "auto": the Llama family is the one model family implemented.
RUNNERS: dict[str, RunnerFactory] = {"auto": _llama, "llama": _llama, "null": _null}


def build_runner(cfg: StageConfig, tp: TPGroup) -> ModelRunner:
    """This rank's runner: its layers of `cfg.model_dir` on its device, as `model_impl` says."""
    model_cfg = ModelConfig.from_dir(cfg.model_dir)
    layers: LayerRange = partition_layers(model_cfg.num_layers, cfg.num_stages,
                                          cfg.layer_override)[cfg.stage_index]
    device = rank_device(cfg, tp.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = StageShape(layers, model_cfg.hidden_size, model_cfg.vocab_size,
                       resolve_dtype(cfg.dtype, device), device)
    return RUNNERS[cfg.model_impl](cfg, model_cfg, shape, tp)


def build_stage_rank(cfg: StageConfig, tp: TPGroup) -> StageRank:
    """This rank's part of the stage. Every rank of the group calls it (the ranks agree on
    the pool size: the smallest any of them fits)."""
    runner = build_runner(cfg, tp)
    return StageRank(runner, tp, tp.min_int(runner.capacity.num_blocks))
