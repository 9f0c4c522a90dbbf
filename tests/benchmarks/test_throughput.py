"""The throughput benchmark's plot: throughput against stages and each stage's bubble."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.throughput import plot_throughput

    rows = [{"stages": p, "output_tok_s": 1000.0 / p, "vs_1_stage": 1.0 / p,
             "stage_figures": [{"bubble": 0.1 * i, "step_ms": 2.0} for i in range(p)]}
            for p in (1, 2, 4)]
    png = tmp_path / "w4.png"
    assert plot_throughput(rows, png, {"model": "/m/llama3-8b", "requests": 256,
                                       "prompt_len": 512, "output_len": 256,
                                       "device": "cuda", "revision": "abc"})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
