"""One TP rank of stage TP_STAGE (of two) at TP size 2 over gloo: `python -m
tests.stage_worker.tp_step_worker RANK PORT MODEL_DIR TP_STAGE PROMPTS_JSON MAX_NEW OUT`.

Rank 0 leads that stage and also runs the other stage at TP size 1, linked over loopback,
through `step_script.converse`; rank 1 follows with `tp_rank.follow`. Each rank writes the
outputs its TP stage's runner returned (OUT.safetensors) and rank 0 the tokens (OUT.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from stage_worker.build import build_stage_rank
from stage_worker.leader import StageLeader
from stage_worker.parallel import TPGroup, init_tp_group
from stage_worker.tp_rank import follow
from tests.stage_worker.step_script import converse, link, record_outputs, stage_config
from tests.stage_worker.tp_harness import exit_now


def main(argv: list[str]) -> None:
    rank, port, model_dir, tp_stage = int(argv[0]), int(argv[1]), Path(argv[2]), int(argv[3])
    prompts, max_new, out = json.loads(Path(argv[4]).read_text()), int(argv[5]), Path(argv[6])
    torch.set_num_threads(1)
    tp = init_tp_group(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
    stage = build_stage_rank(stage_config(model_dir, tp_stage, 2), tp)
    outputs = record_outputs(stage.runner)
    if rank == 0:
        other = build_stage_rank(stage_config(model_dir, 1 - tp_stage, 1), TPGroup())
        leaders = [StageLeader(stage, 60.0), StageLeader(other, 60.0)]
        first, last = leaders if tp_stage == 0 else leaders[::-1]
        link(first, last)
        tokens = converse(first, last, prompts, max_new)
        out.with_suffix(".json").write_text(json.dumps(tokens))
        for leader in leaders:
            leader.shutdown()
    else:
        follow(stage)
    save_file({str(i): t.contiguous() for i, t in enumerate(outputs)},
              out.with_suffix(".safetensors"))
    torch.distributed.barrier()
    exit_now()


if __name__ == "__main__":
    main(sys.argv[1:])
