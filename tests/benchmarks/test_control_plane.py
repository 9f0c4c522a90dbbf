"""W6's per-part CPU against one part's: the ratio rounds compare by."""

from __future__ import annotations

from benchmarks.control_plane import cpu_over


def test_each_part_over_the_engine_core() -> None:
    cpu = {"engine core": 200, "stage 0": 300, "client": 100, "serve": 0}
    assert cpu_over(cpu, "engine core") == {"stage 0": 1.5, "client": 0.5, "serve": 0.0}


def test_no_ratio_without_the_part() -> None:
    assert cpu_over({"stage 0": 300}, "engine core") == {}
    assert cpu_over({"engine core": 0, "stage 0": 300}, "engine core") == {}
