"""One TP rank of a test pipeline: `python -m tests.stage_worker.tp_worker RANK SIZE PORT
MODEL_DIR STAGES PROMPTS_JSON OUT_JSON`. Writes the greedy tokens it generated."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate
from stage_worker.parallel import init_tp_group
from tests.stage_worker.tp_harness import exit_now


def main(argv: list[str]) -> None:
    rank, size, port = int(argv[0]), int(argv[1]), int(argv[2])
    model_dir, stages = Path(argv[3]), int(argv[4])
    prompts = json.loads(Path(argv[5]).read_text())
    max_new = int(argv[7])
    torch.set_num_threads(1)
    tp = init_tp_group(rank, size, f"tcp://127.0.0.1:{port}", "gloo")
    pipe = LocalPipeline(LocalPipelineConfig(model_dir, stages, num_blocks=128), tp)
    out = greedy_generate(pipe, prompts, max_new_tokens=max_new)
    Path(argv[6]).write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    exit_now()


if __name__ == "__main__":
    main(sys.argv[1:])
