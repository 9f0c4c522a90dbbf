"""A non-leader TP rank of a stage: `python -m stage_worker.tp_rank RANK INIT_URL CONFIG_JSON`.

Spawned by the stage leader. Joins the TP group, builds its shard of the stage, then runs
`StageRank.step` on every plan the leader fans out (see `stage_worker.tp_fanout`) until told
to shut down. Exits non-zero if the group breaks, which takes the stage down with it. Beats
on a pipe to the leader all along (`stage_worker.tp_liveness`), and exits when the leader
is gone.
"""

from __future__ import annotations

import logging
import os
import sys

from kernels.platform import distributed_backend
from stage_worker import tp_fanout
from stage_worker.build import build_stage_rank, rank_device
from stage_worker.config import StageConfig
from stage_worker.parallel import init_tp_group
from stage_worker.stage_rank import StageRank
from stage_worker.tp_fanout import FanoutKind
from stage_worker.tp_liveness import FD_ENV, start_beating

log = logging.getLogger("stagemesh.tp_rank")


def follow(rank: StageRank) -> None:
    """Mirror the leader's steps until SHUTDOWN. The leader checked every plan first."""
    while True:
        msg = tp_fanout.receive(rank.tp)
        if msg.kind is FanoutKind.SHUTDOWN:
            return
        if msg.kind is FanoutKind.RESET:
            rank.reset()
            continue
        assert msg.plan is not None
        rank.step(msg.plan, None, msg.fed)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {argv[0]}] %(message)s")
    index, init_url, cfg = int(argv[0]), argv[1], StageConfig.from_json(argv[2])
    if (fd := os.environ.get(FD_ENV)) is not None:
        start_beating(int(fd))  # before anything slow: the leader watches from its start
    backend = distributed_backend(rank_device(cfg, index))
    tp = init_tp_group(index, cfg.tp_size, init_url, backend)
    follow(build_stage_rank(cfg, tp))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
