"""The default model (SmolLM2-135M-Instruct) against HF transformers, fp32 on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate
from stage_worker.step_input import SeqChunk
from tests.default_model import (
    EOS,
    MAX_NEW,
    chat_prompts,
    default_model_dir,
    hf_greedy,
    hf_model,
)
from tests.stage_worker.tp_harness import run_tp


def test_logits_match_hf_fp32() -> None:
    """Prefill and 16 teacher-forced decode steps; prints the measured max abs difference."""
    prompt = chat_prompts()[0]
    ids = prompt + hf_greedy()[0][:16]
    with torch.no_grad():
        ref = hf_model()(torch.tensor([ids])).logits[0]
    pipe = LocalPipeline(LocalPipelineConfig(default_model_dir(), 1, num_blocks=16))
    table = list(range(8))
    got = [pipe.step([SeqChunk(0, 0, len(prompt), table)], torch.tensor(prompt))[0]]
    for pos in range(len(prompt), len(ids) - 1):
        got.append(pipe.step([SeqChunk(0, pos, 1, table)], torch.tensor([ids[pos]]))[0])
    diff = (torch.stack(got) - ref[len(prompt) - 1:len(ids) - 1]).abs().max().item()
    print(f"default model, fp32: max |logits - HF| = {diff:.2e} (logits up to "
          f"{ref.abs().max().item():.1f})")
    # 30 layers of fp32 with a different matmul/SDPA blocking: ~1e-5 measured here.
    assert diff < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_greedy_continuations_match_hf_generate(stages: int) -> None:
    pipe = LocalPipeline(LocalPipelineConfig(default_model_dir(), stages, num_blocks=128))
    ours = greedy_generate(pipe, chat_prompts(), MAX_NEW, stop_ids=[EOS])
    assert ours == hf_greedy()
    assert any(len(o) == MAX_NEW for o in ours) or all(o[-1] == EOS for o in ours)


@pytest.mark.slow
def test_tp2_two_stages_over_gloo_matches_hf(tmp_path: Path) -> None:
    """TP=2 splits SmolLM2's 9 query / 3 KV heads unevenly (6+3 / 2+1) across two processes."""
    prompts = chat_prompts()[:4]
    per_rank = run_tp(default_model_dir(), tp=2, stages=2, prompts=prompts, max_new=24,
                      workdir=tmp_path)
    want = [o[:24] for o in hf_greedy()[:4]]
    for rank_out in per_rank:
        # The worker ignores EOS; compare up to HF's stop.
        assert [o[:len(w)] for o, w in zip(rank_out, want, strict=True)] == want
