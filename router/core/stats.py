"""The engine core's answer to `StatsRequest`: its scheduler's and ledger's counters and
each stage's live figures (`Describe`), as the `CoreStats` message the fronts turn into
GetStats."""

from __future__ import annotations

from collections.abc import Set

from router.core.ledger import Ledger
from router.core.messages import CoreStats, StageStat, StatsRequest
from router.pipeline import Pipeline
from router.scheduler import SchedulerStats


async def stage_stats(pipeline: Pipeline, ready: bool, timeout_s: float) -> list[StageStat]:
    """Every stage's figures (a stage that does not answer within `timeout_s` is reported
    not ready), with the transport of the hop after it."""
    infos = await pipeline.stage_stats(timeout_s)
    hops = pipeline.hop_transports
    stages = []
    for i, info in enumerate(infos):
        hop = hops[i] if i < len(hops) else ""  # the last stage has no hop
        stages.append(StageStat(i, False, transport=hop) if info is None else StageStat(
            i, ready, info.layer_start, info.layer_end, info.kv_blocks_used,
            info.num_kv_blocks, info.num_sequences, hop, info.device, info.steps,
            info.step_time_ms, info.bubble_fraction))
    return stages


def core_stats(msg: StatsRequest, stats: SchedulerStats, stages: list[StageStat], steps: int,
               ledger: Ledger, fronts: Set[int]) -> CoreStats:
    kv = stats.kv
    return CoreStats(
        msg.request_id, stats.num_waiting, stats.num_running, kv.num_used_blocks,
        kv.num_blocks, kv.num_cached_free_blocks, kv.prefix_query_tokens,
        kv.prefix_hit_tokens, steps, stages, ledger.requests_finished,
        dict(ledger.finished_by_front), sorted(fronts))
