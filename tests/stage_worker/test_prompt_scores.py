"""Prompt log probabilities from the stage itself: a prompt scored over two prefill chunks,
beside a sequence that asks for none, against HF transformers' log-softmax of the same
prompt (fp32, on CPU and on CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foundation.sampling_params import SamplingParams
from stage_worker.build import build_stage_rank
from stage_worker.config import StageConfig
from stage_worker.leader import StageLeader
from stage_worker.parallel import TPGroup
from stage_worker.plan import StageCachedSeq, StageNewSeq, StagePlan
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

TOP = 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prompt_scored_over_two_chunks_matches_hf(device: str, tmp_path: Path) -> None:
    model = write_tiny_checkpoint("llama_gqa_untied", tmp_path).to(device)
    prompt = torch.randint(0, 160, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    other = [5, 9, 2, 7, 1]
    with torch.no_grad():
        want = model(torch.tensor([prompt], device=device)).logits[0].float() \
            .log_softmax(-1)[:-1].cpu()
    cfg = StageConfig(tmp_path, device=device, dtype="float32", block_size=16, num_blocks=32,
                      max_num_batched_tokens=256, max_num_seqs=4)
    leader = StageLeader(build_stage_rank(cfg, TPGroup()), step_timeout_s=30.0)
    try:
        scored = SamplingParams(temperature=0.0, prompt_logprobs=TOP)
        first = leader.run_step(StagePlan(0, (
            StageNewSeq(1, tuple(prompt), len(prompt), (0, 1), 0, 10, False, scored),
            StageNewSeq(2, tuple(other), len(other), (2,), 0, len(other), True,
                        SamplingParams(temperature=0.0))), (), ()))
        second = leader.run_step(StagePlan(1, (), (
            StageCachedSeq(1, (), 10, len(prompt) - 10, (), True),
            StageCachedSeq(2, (), len(other), 1, (first.sampled[2],), True)), ()))
    finally:
        leader.shutdown()
    records = [*first.prompt_logprobs, *second.prompt_logprobs]
    # The first chunk scores tokens 1..10 (rows 0..9); the second tokens 11..22 (its last
    # row samples instead: the token after the prompt is not the prompt's).
    assert [(r.seq_id, r.start, len(r.token_ids)) for r in records] == [(1, 1, 10), (1, 11, 12)]
    token_ids = [t for r in records for t in r.token_ids]
    logprobs = [v for r in records for v in r.logprobs]
    assert token_ids == prompt[1:]
    assert logprobs == pytest.approx([want[i, t].item() for i, t in enumerate(prompt[1:])],
                                     abs=1e-4)
    top = want.topk(TOP)
    assert [list(ids) for r in records for ids in r.top_token_ids] == top.indices.tolist()
    assert [v for r in records for values in r.top_logprobs for v in values] == \
        pytest.approx(top.values.flatten().tolist(), abs=1e-4)
    with torch.no_grad():  # the sampled token is the greedy one after the whole prompt
        last = model(torch.tensor([prompt], device=device)).logits[0, -1]
    assert second.sampled[1] == int(last.argmax())
