"""The W6 floor: its skeleton mesh comes up, steps, streams and is measured by part."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from benchmarks.w6_floor import measure


@pytest.mark.parametrize(("hops", "forwarded"), [("unix", False), ("tcp", False),
                                                 ("unix", True)])
def test_the_skeleton_mesh_steps_and_streams(tmp_path: Path, hops: str,
                                             forwarded: bool) -> None:
    # 8 sequences in 2 micro-batches of 4, a response every 2 tokens: every part works,
    # with the hops on either kind of socket, and with stage 1's plans forwarded by stage 0
    # (stage 1 steps on what stage 0 sends it, the core plans for stage 0 alone).
    got = measure(seqs=8, micro_batches=2, hidden=16, interval=2, window=4, per_message=2,
                  window_s=0.5, run_dir=tmp_path, hops=hops, forwarded=forwarded)
    assert got["steps_per_s"] > 0
    # Each step gives 4 sequences a token, and each token reaches a client.
    assert got["tokens_per_s"] > 0
    assert set(got["cpu_us_per_step_by_part"]) == {"stage 0", "stage 1", "engine core",
                                                   "front", "client"}
    assert mp.active_children() == []  # every process of the skeleton is gone
