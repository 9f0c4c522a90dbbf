"""The scheduler benchmark runs end to end and writes its JSON (a tiny configuration)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_scheduler import run_case

REPO = Path(__file__).resolve().parents[3]


def test_run_case_times_steady_decodes() -> None:
    row = run_case(num_seqs=12, steps=20, pipeline=2, run_ahead=True, prompt_len=6,
                   block_size=4)
    assert row["running"] == 12 and row["seqs/step"] == 6.0  # two balanced micro-batches
    assert row["us/step"] > 0 and row["preemptions"] == 0


def test_main_writes_json_with_revision(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_scheduler", "--seqs", "8", "--steps", "10",
         "--repeats", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["revision"] and doc["config"]["seqs"] == 8 and doc["config"]["repeats"] == 1
    assert doc["config"]["python_ns_per_op"] > 0
    assert [(r["P"], r["run_ahead"]) for r in doc["results"]] == [
        (1, False), (1, True), (2, False), (4, False), (4, True)]
    assert "us/step" in done.stdout
