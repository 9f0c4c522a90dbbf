"""A fixed two-stage conversation with the stage leaders, shared by the TP step test and its
worker processes: chunked prefill, batched decodes (run-ahead inputs among them), a block
copy, a free and a plan that computes nothing, with every runner output recorded."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from foundation.sampling_params import SamplingParams
from stage_worker.config import StageConfig
from stage_worker.leader import StageLeader
from stage_worker.model_runner import InputFill, ModelRunner
from stage_worker.plan import StageCachedSeq, StageNewSeq, StagePlan
from stage_worker.step_input import SeqChunk

BLOCK, BLOCKS = 8, 64
GREEDY = SamplingParams(temperature=0.0)
# Sequence 1 also asks for prompt log probabilities: the last stage computes logits for its
# prompt rows too (every TP rank the same rows: the logits are gathered across ranks).
SCORED = SamplingParams(temperature=0.0, prompt_logprobs=2)


def stage_config(model_dir: Path, stage_index: int, tp_size: int) -> StageConfig:
    return StageConfig(model_dir, stage_index=stage_index, num_stages=2,
                       tp_size=tp_size, block_size=BLOCK, num_blocks=BLOCKS,
                       step_timeout_s=60.0)


def record_outputs(runner: ModelRunner) -> list[torch.Tensor]:
    """Every output `runner.execute` returns from now on, copied, in call order."""
    seen: list[torch.Tensor] = []
    execute = runner.execute

    def recording(chunks: Sequence[SeqChunk], inputs: torch.Tensor,
                  fill: InputFill | None = None) -> torch.Tensor:
        out = execute(chunks, inputs, fill)
        seen.append(out.detach().clone())
        return out

    runner.execute = recording  # type: ignore[method-assign]
    return seen


def link(first: StageLeader, last: StageLeader) -> None:
    """A loopback data-plane link from `first` to `last`, and the feedback link back."""
    token = b"t" * 32
    first.connect_downstream(last.listen_upstream("127.0.0.1", token, 0), token, 0)
    last.connect_feedback(first.listen_feedback("127.0.0.1", token, 0), token, 0)
    deadline = time.monotonic() + 10
    while not (first.linked and last.linked and first.links.has_feedback):
        assert time.monotonic() < deadline, "data-plane link never came up"
        time.sleep(0.01)


def converse(first: StageLeader, last: StageLeader, prompts: list[list[int]],
             max_new: int) -> list[list[int]]:
    """Greedy tokens per prompt after the script; ends with a reset of both stages.
    Sequence 0's decodes take their input from the previous step (run-ahead: the first
    stage reads it from the feedback link); sequence 1's come as appended tokens, and its
    prompt is scored (prompt log probabilities) over its two prefill chunks."""
    a, b = prompts
    ta, tb = list(range(0, 8)), list(range(8, 16))
    split = len(b) // 2
    out: list[list[int]] = [[], []]

    def run(plan: StagePlan) -> None:
        first.run_step(plan)
        for seq_id, token_id in last.run_step(plan).sampled.items():
            out[seq_id].append(token_id)

    run(StagePlan(0, (StageNewSeq(0, tuple(a), len(a), tuple(ta), 0, len(a), True, GREEDY),
                      StageNewSeq(1, tuple(b), len(b), tuple(tb), 0, split, False, SCORED)),
                  (), ()))
    run(StagePlan(1, (), (StageCachedSeq(0, (), len(a), 1, (), True, 0),
                          StageCachedSeq(1, (), split, len(b) - split, (), True)), ()))
    for step in range(2, max_new + 1):
        cached = [StageCachedSeq(0, (), len(a) + step - 1, 1, (), True, step - 1),
                  StageCachedSeq(1, (), len(b) + step - 2, 1, (out[1][-1],), True)]
        run(StagePlan(step, (), tuple(cached), ()))
    # Sequence 0 goes and a block is copied into an unused one; nothing is computed.
    run(StagePlan(max_new + 1, (), (), (0,), ((tb[0], 40),)))
    run(StagePlan(max_new + 2, (), (StageCachedSeq(1, (), len(b) + max_new - 1, 1,
                                                   (out[1][-1],), True),), ()))
    first.reset()
    last.reset()
    return out
