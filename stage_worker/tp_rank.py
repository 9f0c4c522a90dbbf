"""A non-leader TP rank of a stage: `python -m stage_worker.tp_rank RANK INIT_URL CONFIG_JSON`.

Spawned by the stage leader. Joins the TP group, builds its shard of the stage, then runs
`StageRank.step` on every plan the leader fans out (see `stage_worker.tp_fanout`) until told
to shut down. Exits non-zero if the group breaks, which takes the stage down with it. Beats
on a pipe to the leader all along (`stage_worker.tp_liveness`), and exits when the leader
is gone (one line, not a traceback, when a collective finds it gone first).
"""

from __future__ import annotations

import logging
import os
import sys
import time

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
    leader = os.getppid()
    try:
        tp = init_tp_group(index, cfg.tp_size, init_url, backend)
        follow(build_stage_rank(cfg, tp))
    except RuntimeError as e:  # the group broke: a collective's peer closed or timed out
        if not _gone(leader):
            raise  # the leader lives: the traceback says where the group broke
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.error("the stage leader (pid %d) is gone; exiting (%s)", leader, first)
        return 1
    return 0


def _gone(leader: int, wait_s: float = 1.0) -> bool:
    """Whether the leader process has ended: this rank's parent changes when it does. The
    leader's sockets close before the kernel gives its children a new parent, so a rank
    that saw them close waits up to `wait_s` for that."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == leader:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
