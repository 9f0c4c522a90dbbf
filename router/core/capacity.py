"""What the core may plan, from the router's flags, the model and what the stages reported.

Pure: `plan_capacity` turns (CoreConfig, ModelConfig, PipelineShape) into the scheduler's
and the KV manager's configs and the request limits, or refuses flags the stages cannot
honour with one line that says what to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from foundation.model_config import ModelConfig
from kvcache import KVCacheConfig
from router.core.config import CoreConfig
from router.pipeline import PipelineShape
from router.requests import RequestLimits
from router.scheduler import SchedulerConfig

log = logging.getLogger("stagemesh.router")


class CapacityError(ValueError):
    """A router flag asks for more than a stage reported it can do."""


@dataclass(frozen=True)
class Capacity:
    """scheduler / kv: the configs the scheduler is built from; limits: what a request may
    ask for (its context is the model's, capped by --max-model-len and by the KV pool)."""

    scheduler: SchedulerConfig
    kv: KVCacheConfig
    limits: RequestLimits


def plan_capacity(cfg: CoreConfig, model: ModelConfig, shape: PipelineShape) -> Capacity:
    """Raises CapacityError when --max-num-batched-tokens or --max-num-seqs exceed the
    smallest stage's, naming that stage."""
    step_tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
    _check_flag("--max-num-batched-tokens", step_tokens, shape, "max_num_batched_tokens",
                "the largest step it sized its activations for")
    _check_flag("--max-num-seqs", cfg.max_num_seqs, shape, "max_num_seqs",
                "the most sequences it takes in one step")
    context = model.max_position_embeddings
    if model.sliding_window is not None and model.sliding_window <= context:
        log.warning("the model attends over a sliding window of %d tokens, which stagemesh "
                    "does not implement: its context is capped at the window (exact up to "
                    "there)", model.sliding_window)
    if cfg.max_model_len > context:
        log.warning("--max-model-len %d exceeds the model's context of %d tokens (its "
                    "max_position_embeddings): capped at %d", cfg.max_model_len, context,
                    context)
    if cfg.max_model_len:
        context = min(context, cfg.max_model_len)
    micro_batches = _micro_batches(cfg, shape)
    max_len = min(context, shape.num_kv_blocks * shape.block_size)
    if max_len < context:
        log.warning("context capped at %d tokens: the KV pool holds %d blocks of %d",
                    max_len, shape.num_kv_blocks, shape.block_size)
    scheduler = SchedulerConfig(
        max_num_batched_tokens=step_tokens, max_num_seqs=cfg.max_num_seqs,
        max_model_len=max_len, max_inflight_steps=micro_batches, run_ahead=cfg.run_ahead,
        run_ahead_depth=cfg.max_run_ahead_depth,
        max_queued_requests=cfg.max_queued_requests, max_queued_tokens=cfg.max_queued_tokens)
    kv = KVCacheConfig(shape.num_kv_blocks, shape.block_size, cfg.enable_prefix_caching)
    return Capacity(scheduler, kv, RequestLimits(max_model_len=max_len,
                                                 vocab_size=model.vocab_size))


def _micro_batches(cfg: CoreConfig, shape: PipelineShape) -> int:
    """--micro-batches, or one per device the stages compute on (`PipelineShape.num_devices`).
    Raises CapacityError past one per stage (a stage would hold two steps at once)."""
    if cfg.micro_batches > shape.num_stages:
        raise CapacityError(
            f"--micro-batches {cfg.micro_batches} exceeds the pipeline's {shape.num_stages} "
            f"stage(s): at most one micro-batch per stage; give {shape.num_stages} or less "
            f"(0: one per device)")
    chosen = cfg.micro_batches or shape.num_devices
    if chosen < shape.num_stages:
        log.info("%d micro-batch(es) in flight over %d stages (%s)", chosen, shape.num_stages,
                 "--micro-batches" if cfg.micro_batches else
                 f"the stages compute on {shape.num_devices} device(s)")
    return chosen


def _check_flag(flag: str, value: int, shape: PipelineShape, field: str, meaning: str) -> None:
    have = getattr(shape, field)
    if value > have:
        stage = shape.limiting_stage[field]
        raise CapacityError(
            f"{flag} {value} exceeds what stage {stage} reports as {meaning} ({have}): "
            f"start the stages with --{field.replace('_', '-')} {value} or more, or give the "
            f"router {flag} {have} or less")
