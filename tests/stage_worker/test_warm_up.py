"""The runner's start-up warm-up (`stage_worker.runner.warm_up_chunks`): its steps reach
every attention launch a served step can reach, so no kernel variant is first compiled
while requests wait (on CUDA, marker `gpu`: nothing compiles after warm-up)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from foundation.model_config import ModelConfig
from kernels.argmax import argmax_rows
from kernels.attention_launch import PREFILL_LAUNCH, choose_launch
from stage_worker.partition import LayerRange
from stage_worker.runner import StageRunner, StageRunnerConfig, warm_up_chunks
from stage_worker.step_input import SeqChunk
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

SMS = 132  # H200


def launch_class(steps: list[SeqChunk], kv_heads: int, group: int) -> tuple[bool, bool]:
    """(prefill launch, split KV) of the attention launch for one step, as
    `paged_attention_triton` chooses them."""
    rows = max(c.num_new for c in steps) * group
    launch, splits = choose_launch(rows, len(steps), kv_heads, SMS)
    return launch is PREFILL_LAUNCH, splits > 1


@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (9, 3), (8, 8), (32, 4), (14, 2)])
@pytest.mark.parametrize(("max_tokens", "max_seqs"), [(4096, 256), (2048, 64), (512, 8)])
def test_warm_up_reaches_every_launch_a_step_can(heads: int, kv_heads: int, max_tokens: int,
                                                 max_seqs: int) -> None:
    group = heads // kv_heads
    warm = warm_up_chunks(max_tokens, max_seqs, group, 16, 100_000,
                          PREFILL_LAUNCH.block_m)
    covered = {launch_class(s, kv_heads, group) for s in warm}
    reachable = {launch_class([SeqChunk(i, 0, q, range(1)) for i in range(n)], kv_heads, group)
                 for q, n in itertools.product(range(1, 300), range(1, max_seqs + 1))
                 if q * n <= max_tokens}
    assert covered == reachable
    for step in warm:  # every step fits the limits a served step has
        assert len(step) <= max_seqs and sum(c.num_new for c in step) <= max_tokens
        for c in step:
            assert len(c.block_table) * 16 >= c.num_computed + c.num_new


def test_warm_up_leaves_out_what_the_pool_cannot_hold() -> None:
    steps = warm_up_chunks(4096, 256, 4, 16, 8, 64)
    assert steps and all(len(c.block_table) <= 8 for s in steps for c in s)
    assert max(c.num_new for s in steps for c in s) < 4096


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("model", ["llama_head_dim_32", "llama_gqa_untied"])
def test_nothing_compiles_while_serving_after_warm_up(model: str, graphs: bool, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Sixty random mixed, prefill and decode steps after start-up, each with the greedy
    sampler's argmax over its logits: no Triton kernel is compiled (each would stall its
    step for about half a second). Head dim 32 runs the Triton attention; head dim 8 the
    torch one beside the other Triton kernels. (Kernels compiled by earlier tests of the
    process count as warm: run it alone to be sure.)"""
    import triton.runtime.jit as jit

    write_tiny_checkpoint(model, tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    runner = StageRunner(StageRunnerConfig(tmp_path, LayerRange(0, cfg.num_layers, True, True),
                                           torch.bfloat16, torch.device("cuda"), block_size=16,
                                           num_blocks=64, max_num_batched_tokens=512,
                                           max_num_seqs=32, cuda_graphs=graphs), cfg)
    compiled: list[str] = []
    original = jit.JITFunction._do_compile

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiled.append(self.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "_do_compile", counting)
    rng = random.Random(0)
    for _ in range(60):
        decodes = rng.randint(0, 31)
        prefills = rng.randint(0 if decodes else 1, 32 - decodes)
        chunks = [SeqChunk(i, rng.randint(0, 400), 1, range(26)) for i in range(decodes)]
        budget = 512 - decodes
        for j in range(prefills):  # the model's 512 positions are 32 blocks
            q = rng.randint(1, max(1, min(312, budget // (prefills - j))))
            budget -= q
            chunks.append(SeqChunk(decodes + j, rng.randint(0, 200), q, range(32)))
        tokens = sum(c.num_new for c in chunks)
        out = runner.execute(chunks, torch.randint(0, cfg.vocab_size, (tokens,)))
        assert torch.isfinite(out).all()
        argmax_rows(out)  # the greedy sampler's pick
    torch.cuda.synchronize()
    assert compiled == []
