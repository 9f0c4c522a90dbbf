"""TP=2 in two real processes over gloo gives the single-process greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate
from stage_worker.parallel import shard_heads
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint
from tests.stage_worker.tp_harness import run_tp


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "expect"),
    [
        (8, 2, 2, [(0, 4, 0, 1), (4, 8, 1, 2)]),
        (9, 3, 2, [(0, 6, 0, 2), (6, 9, 2, 3)]),  # uneven: SmolLM2's 9 heads over 2 ranks
        (8, 1, 2, [(0, 4, 0, 1), (4, 8, 0, 1)]),  # one KV head replicated on both ranks
        (8, 2, 4, [(0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]),
    ],
)
def test_shard_heads(heads: int, kv: int, tp: int, expect: list[tuple[int, ...]]) -> None:
    got = [shard_heads(heads, kv, tp, r) for r in range(tp)]
    assert [(h.q_start, h.q_end, h.kv_start, h.kv_end) for h in got] == expect


def test_shard_heads_refuses_impossible_layout() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        shard_heads(8, 3, 2, 0)
    with pytest.raises(ValueError, match="exceeds"):
        shard_heads(2, 1, 4, 0)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama_gqa_untied", "llama_one_kv_head", "qwen2_qkv_bias",
                                     "llama3_rope_scaling"])
def test_tp2_over_gloo_matches_single_process(variant: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_tiny_checkpoint(variant, ckpt)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (7, 19)]
    ref = greedy_generate(LocalPipeline(LocalPipelineConfig(ckpt, 1, num_blocks=128)),
                          prompts, max_new_tokens=16)
    per_rank = run_tp(ckpt, tp=2, stages=2, prompts=prompts, max_new=16, workdir=tmp_path)
    assert per_rank == [ref, ref]
