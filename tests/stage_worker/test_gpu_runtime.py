"""The runtime on CUDA against HF transformers on CUDA (marker `gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foundation.model_config import ModelConfig
from stage_worker.offline import LocalPipeline, LocalPipelineConfig
from stage_worker.partition import LayerRange
from stage_worker.runner import StageRunner, StageRunnerConfig
from stage_worker.step_input import SeqChunk
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "tol"), [
    (torch.float32, 2e-3),  # TF32 is off by default for matmul in torch; SDPA kernels differ
    (torch.bfloat16, 5e-2),  # bf16 has 8 mantissa bits: relative error ~4e-3 per op
])
@pytest.mark.parametrize("variant", ["llama_gqa_untied", "qwen2_qkv_bias", "llama3_rope_scaling",
                                     "llama_head_dim_32"])
def test_cuda_logits_match_hf(variant: str, dtype: torch.dtype, tol: float,
                              tmp_path: Path) -> None:
    model = write_tiny_checkpoint(variant, tmp_path).to("cuda", dtype)
    ids = torch.randint(0, 160, (48,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None].cuda()).logits[0].float()
    pipe = LocalPipeline(LocalPipelineConfig(tmp_path, 2, dtype, torch.device("cuda"),
                                             block_size=16, num_blocks=8))
    table = [3, 1, 6, 0]
    got = [pipe.step([SeqChunk(0, 0, 40, table)], ids[:40])[0]]
    for pos in range(40, 48):
        got.append(pipe.step([SeqChunk(0, pos, 1, table)], ids[pos:pos + 1])[0])
    diff = (torch.stack(got) - ref[39:]).abs().max().item()
    assert diff < tol * ref.abs().max().item(), diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_graphs_match_eager_steps(dtype: torch.dtype, tmp_path: Path) -> None:
    """Three sequences of different lengths decode through the batch-4 graph (one padding
    row) and eagerly, from the same prefill: the same logits and greedy tokens."""
    write_tiny_checkpoint("llama_head_dim_32", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    layers = LayerRange(0, cfg.num_layers, True, True)
    runners = [StageRunner(StageRunnerConfig(tmp_path, layers, dtype, torch.device("cuda"),
                                             block_size=16, num_blocks=32, cuda_graphs=g), cfg)
               for g in (True, False)]
    assert runners[0].graphs is not None and runners[1].graphs is None
    assert runners[0].num_blocks == runners[1].num_blocks == 32
    gen = torch.Generator().manual_seed(0)
    lens = [5, 23, 40]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    tokens: list[list[list[int]]] = []
    logits: list[list[torch.Tensor]] = []
    for runner in runners:
        first = runner.execute([SeqChunk(i, 0, n, tables[i]) for i, n in enumerate(lens)],
                               torch.cat(prompts))
        nxt = first.argmax(-1)
        seq_tokens, seq_logits = [nxt.tolist()], [first]
        for step in range(12):
            out = runner.execute([SeqChunk(i, n + step, 1, tables[i])
                                  for i, n in enumerate(lens)], nxt)
            nxt = out.argmax(-1)
            seq_tokens.append(nxt.tolist())
            seq_logits.append(out)
        tokens.append(seq_tokens)
        logits.append(seq_logits)
    assert tokens[0] == tokens[1]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for got, want in zip(logits[0], logits[1], strict=True):
        assert (got - want).abs().max().item() <= tol * want.abs().max().item()


def test_profiled_pool_with_graphs(tmp_path: Path) -> None:
    """The serving configuration: no fixed pool size, so the runner profiles a step first,
    sizes the pool from what is left, then captures its decode graphs."""
    write_tiny_checkpoint("llama_head_dim_32", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    runner = StageRunner(StageRunnerConfig(tmp_path, LayerRange(0, cfg.num_layers, True, True),
                                           torch.bfloat16, torch.device("cuda"), block_size=16,
                                           gpu_memory_utilization=0.05), cfg)
    assert runner.graphs is not None and runner.num_blocks > 0
    first = runner.execute([SeqChunk(0, 0, 20, [5, 9])], torch.arange(20))
    out = runner.execute([SeqChunk(0, 20, 1, [5, 9])], first.argmax(-1))
    assert out.shape == (1, cfg.vocab_size) and torch.isfinite(out).all()
