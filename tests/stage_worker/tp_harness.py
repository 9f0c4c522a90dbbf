"""Run TP ranks as real processes over gloo and collect what each rank wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from foundation.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _run_ranks(module: str, argvs: list[list[str]], timeout: float) -> None:
    """`python -m module *argv` per rank, concurrently; fails with a rank's log if it fails."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv in argvs]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]


def run_tp(model_dir: Path, tp: int, stages: int, prompts: list[list[int]], max_new: int,
           workdir: Path, timeout: float = 300) -> list[list[list[int]]]:
    """The offline pipeline at TP size `tp`: the tokens each rank generated (all ranks must
    agree)."""
    prompts_file = workdir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    port = free_port()
    outs = [workdir / f"rank{rank}.json" for rank in range(tp)]
    _run_ranks("tests.stage_worker.tp_worker",
               [[str(rank), str(tp), str(port), str(model_dir), str(stages), str(prompts_file),
                 str(out), str(max_new)] for rank, out in enumerate(outs)], timeout)
    return [json.loads(o.read_text()) for o in outs]


def run_tp_step(model_dir: Path, tp_stage: int, prompts: list[list[int]], max_new: int,
                workdir: Path, timeout: float = 300
                ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """`step_script.converse` with stage `tp_stage` of two at TP size 2 (see
    `tp_step_worker`): rank 0's tokens, and each rank's outputs of that stage's runner."""
    prompts_file = workdir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    port = free_port()
    outs = [workdir / f"rank{rank}" for rank in range(2)]
    _run_ranks("tests.stage_worker.tp_step_worker",
               [[str(rank), str(port), str(model_dir), str(tp_stage), str(prompts_file),
                 str(max_new), str(out)] for rank, out in enumerate(outs)], timeout)
    outputs = []
    for out in outs:
        saved = load_file(out.with_suffix(".safetensors"))
        outputs.append([saved[str(i)] for i in range(len(saved))])
    return json.loads(outs[0].with_suffix(".json").read_text()), outputs


def exit_now() -> None:
    """Leave without the interpreter's teardown: every rank has passed the barrier, so its
    outputs are written. Destroying gloo's process group while its threads still run has
    ended a rank with "terminate called without an active exception" (std::terminate on a
    joinable thread), a failure of the exit only."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
