"""A non-leader TP rank of a stage: `python -m stage_worker.tp_rank RANK INIT_URL CONFIG_JSON`.

Spawned by the stage leader. Joins the TP group, builds its shard of the stage, then follows
the leader's fan-out (see `stage_worker.leader`) until told to shut down. Exits non-zero if
the group breaks, which takes the stage down with it.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from stage_worker.build import build_executor
from stage_worker.config import StageConfig
from stage_worker.convert import plan_from_proto
from stage_worker.executor import StepExecutor
from stage_worker.leader import PLAN, RESET, SHUTDOWN
from stage_worker.parallel import TPGroup, init_tp_group

log = logging.getLogger("stagemesh.tp_rank")


def config_to_json(cfg: StageConfig) -> str:
    doc = {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()}
    return json.dumps(doc)


def config_from_json(text: str) -> StageConfig:
    doc = json.loads(text)
    doc["model_dir"] = Path(doc["model_dir"])
    if doc.get("layer_override") is not None:
        doc["layer_override"] = tuple(doc["layer_override"])
    return StageConfig(**doc)


def follow(executor: StepExecutor, tp: TPGroup) -> None:
    """Mirror the leader's steps until SHUTDOWN."""
    while True:
        data = tp.broadcast_bytes(None)
        if data == SHUTDOWN:
            return
        if data == RESET:
            executor.state.clear()
            continue
        assert data.startswith(PLAN), f"unknown TP fan-out message {data[:1]!r}"
        plan = plan_from_proto(pb.StepPlan.FromString(data[len(PLAN):]))
        chunks, ids = executor.prepare(plan)
        if not chunks:
            continue
        if executor.is_first:
            assert ids is not None
            inputs = ids
        else:
            shape = executor.hidden_shape(plan.num_tokens)
            inputs = tp.broadcast(torch.empty(shape, dtype=executor.shape.dtype,
                                              device=executor.shape.device))
        executor.forward(chunks, inputs)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {argv[0]}] %(message)s")
    rank, init_url, cfg = int(argv[0]), argv[1], config_from_json(argv[2])
    tp = init_tp_group(rank, cfg.tp_size, init_url)
    executor, _ = build_executor(cfg, tp)
    agree_on_num_blocks(executor, tp)
    follow(executor, tp)
    return 0


def agree_on_num_blocks(executor: StepExecutor, tp: TPGroup) -> int:
    """Every rank's pool size, reduced to the minimum (ranks with fewer KV heads fit more)."""
    mine = executor.runner.num_blocks if executor.runner is not None else 1 << 30
    if tp.size == 1:
        return mine
    t = torch.tensor([mine], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=tp.control)
    return int(t.item())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
