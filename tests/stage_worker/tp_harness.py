"""Run a pipeline with TP ranks as real processes over gloo and collect each rank's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from foundation.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def run_tp(model_dir: Path, tp: int, stages: int, prompts: list[list[int]], max_new: int,
           workdir: Path, timeout: float = 300) -> list[list[list[int]]]:
    """Returns the tokens each rank generated (all ranks must agree)."""
    prompts_file = workdir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    port = free_port()
    procs, outs = [], []
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for rank in range(tp):
        out = workdir / f"rank{rank}.json"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.stage_worker.tp_worker", str(rank), str(tp), str(port),
             str(model_dir), str(stages), str(prompts_file), str(out), str(max_new)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return [json.loads(o.read_text()) for o in outs]
