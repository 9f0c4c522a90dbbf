"""The one step routine at TP size 2 over gloo (leader and follower in two processes, the
plan fanned out as integer arrays) gives the TP size 1 outputs and tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_worker.build import build_stage_rank
from stage_worker.leader import StageLeader
from stage_worker.parallel import TPGroup
from tests.stage_worker.step_script import converse, link, record_outputs, stage_config
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint
from tests.stage_worker.tp_harness import run_tp_step

MAX_NEW = 6


def tp1_reference(ckpt: Path, prompts: list[list[int]],
                  tp_stage: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Both stages at TP size 1 in this process: tokens, and stage `tp_stage`'s outputs."""
    leaders = [StageLeader(build_stage_rank(stage_config(ckpt, i, 1), TPGroup()), 60.0)
               for i in range(2)]
    outputs = record_outputs(leaders[tp_stage].rank.runner)
    first, last = leaders
    link(first, last)
    try:
        return converse(first, last, prompts, MAX_NEW), outputs
    finally:
        for leader in leaders:
            leader.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp_stage", [0, 1], ids=["first-stage-at-tp2", "last-stage-at-tp2"])
def test_step_routine_at_tp2_matches_tp1(tp_stage: int, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_tiny_checkpoint("llama_gqa_untied", ckpt)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (9, 23)]
    want_tokens, want = tp1_reference(ckpt, prompts, tp_stage)
    tokens, per_rank = run_tp_step(ckpt, tp_stage, prompts, MAX_NEW, tmp_path)
    assert tokens == want_tokens
    for outputs in per_rank:  # both ranks hold the whole output (all-reduced / all-gathered)
        assert [o.shape for o in outputs] == [w.shape for w in want]
        for got, ref in zip(outputs, want, strict=True):
            # fp32 with the row-parallel sums split over two ranks: rounding only, ~1e-6.
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
