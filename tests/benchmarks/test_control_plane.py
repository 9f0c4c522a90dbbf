"""W6's per-part CPU against one part's: the ratio rounds compare by."""

from __future__ import annotations

import pytest

from benchmarks.control_plane import client_restart_env, cpu_over, floor
from foundation.grpc_core import EXPERIMENTS_ENV, LEGACY_IO


def test_each_part_over_the_engine_core() -> None:
    cpu = {"engine core": 200, "stage 0": 300, "client": 100, "serve": 0}
    assert cpu_over(cpu, "engine core") == {"stage 0": 1.5, "client": 0.5, "serve": 0.0}


def test_no_ratio_without_the_part() -> None:
    assert cpu_over({"stage 0": 300}, "engine core") == {}
    assert cpu_over({"engine core": 0, "stage 0": 300}, "engine core") == {}


def test_the_client_restarts_on_the_mesh_grpc_setting_only_when_asked_and_unset() -> None:
    env = client_restart_env("mesh", {"PATH": "/bin"})
    assert env == {"PATH": "/bin", EXPERIMENTS_ENV: LEGACY_IO}
    assert client_restart_env("mesh", {EXPERIMENTS_ENV: ""}) is None  # the operator's value
    assert client_restart_env("mesh", {EXPERIMENTS_ENV: LEGACY_IO}) is None  # restarted
    assert client_restart_env("default", {}) is None


def test_the_floor_beside_a_run_is_the_skeleton_at_the_model_width() -> None:
    """`--floor`: the skeleton comes up at the default model's width, and the run's share
    of it is its steps/s over the floor's."""
    got = floor("default", seqs=8, micro_batches=2, interval=2, steps_per_s=100.0,
                window_s=0.5)
    assert got["floor_steps_per_s"] > 0
    assert got["vs_floor"] == pytest.approx(100.0 / got["floor_steps_per_s"])
    assert set(got["floor_cpu_us_per_step_by_part"]) == {"stage 0", "stage 1", "engine core",
                                                         "front", "client"}
