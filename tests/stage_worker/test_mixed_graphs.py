"""Piecewise graphs of prefill and mixed steps (`stage_worker.mixed_graphs`) against eager
steps: on CPU the pieces run eagerly over the graphs' padded buffers (what a replay
computes, without the capture), on the GPU they are captured and replayed. Each stage role
(whole model, first half, second half), prefills, a step that mixes decodes with a new prompt
and a continued one, then decodes: the same outputs, and the KV pool the same in every block
a sequence owns."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from foundation.model_config import ModelConfig
from stage_worker.kv_pool import KVPool
from stage_worker.mixed_graphs import MixedGraphs, mixed_buckets
from stage_worker.partition import LayerRange
from stage_worker.runner import StageRunner, StageRunnerConfig
from stage_worker.step_input import SeqChunk
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

BLOCKS = 32  # the chunks below use blocks 0..15; BLOCKS is the scratch block on CPU
TABLES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def _layers(role: str, n: int) -> LayerRange:
    half = n // 2
    return {"whole": LayerRange(0, n, True, True), "first": LayerRange(0, half, True, False),
            "last": LayerRange(half, n, False, True)}[role]


def _steps(vocab: int, hidden: int, first: bool, dtype: torch.dtype
           ) -> list[tuple[list[SeqChunk], torch.Tensor]]:
    """(chunks, inputs) of five steps: 3 prompts; 2 decodes + a continued prompt + a new one;
    three steps of 4 decodes."""
    gen = torch.Generator().manual_seed(0)
    plans = [[SeqChunk(0, 0, 5, TABLES[0]), SeqChunk(1, 0, 23, TABLES[1]),
              SeqChunk(2, 0, 30, TABLES[2])],
             [SeqChunk(0, 5, 1, TABLES[0]), SeqChunk(1, 23, 1, TABLES[1]),
              SeqChunk(2, 30, 10, TABLES[2]), SeqChunk(3, 0, 7, TABLES[3])]]
    lens = [6, 24, 40, 7]
    for step in range(3):
        plans.append([SeqChunk(i, n + step, 1, TABLES[i]) for i, n in enumerate(lens)])
    steps = []
    for chunks in plans:
        t = sum(c.num_new for c in chunks)
        inputs = (torch.randint(0, vocab, (t,), generator=gen) if first
                  else torch.randn(t, hidden, generator=gen).to(dtype))
        steps.append((chunks, inputs))
    return steps


def _compare(role: str, dtype: torch.dtype, device: torch.device, tmp_path: Path,
             tol: float) -> int:
    """Run the steps both ways, asserting each step's outputs and the owned KV agree within
    `tol`; returns how many steps ran through the pieces."""
    write_tiny_checkpoint("llama_head_dim_32", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    layers = _layers(role, cfg.num_layers)
    graphs = device.type == "cuda"
    runners = [StageRunner(StageRunnerConfig(tmp_path, layers, dtype, device, block_size=16,
                                             num_blocks=BLOCKS, cuda_graphs=g), cfg)
               for g in (graphs, False)]
    piecewise, eager = runners
    if graphs:
        assert piecewise.mixed_graphs is not None and eager.mixed_graphs is None
    else:  # the pieces over the padded buffers, run eagerly; an extra pool block is scratch
        piecewise.kv = KVPool(replace(piecewise.kv.shape, num_blocks=BLOCKS + 1), device)
        piecewise.mixed_graphs = MixedGraphs(
            piecewise.model, piecewise.kv.layers(), scratch_slot=BLOCKS * 16,
            input_shape=() if layers.is_first else (cfg.hidden_size,), dtype=dtype,
            device=device, max_tokens=256, head_dim=cfg.head_dim, capture=False)
        piecewise.use_graphs = True
    assert piecewise.mixed_graphs is not None
    through_pieces = 0
    piecewise.kv.cache.zero_()
    eager.kv.cache.zero_()
    for chunks, inputs in _steps(cfg.vocab_size, cfg.hidden_size, layers.is_first, dtype):
        assert piecewise.mixed_graphs.covers(chunks)
        through_pieces += 1
        got = piecewise.execute(chunks, inputs.to(device)).float()
        want = eager.execute(chunks, inputs.to(device)).float()
        assert got.shape == want.shape
        top = want.abs().max().item()
        assert (got - want).abs().max().item() <= tol * top, role
        if layers.is_last:
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    owned = [b for table in TABLES for b in table]
    for (k1, v1), (k2, v2) in zip(piecewise.kv.layers(), eager.kv.layers(), strict=True):
        for got_kv, want_kv in ((k1, k2), (v1, v2)):
            gap = (got_kv[owned].float() - want_kv[owned].float()).abs().max().item()
            assert gap <= tol * max(1.0, want_kv[owned].float().abs().max().item()), role
    return through_pieces


def test_buckets_step_by_32_up_to_512() -> None:
    assert mixed_buckets(96) == (32, 64, 96)
    assert mixed_buckets(100) == (32, 64, 96, 128)
    assert mixed_buckets(4096)[-1] == 512 and len(mixed_buckets(4096)) == 16


@pytest.mark.parametrize("role", ["whole", "first", "last"])
def test_pieces_over_padded_buffers_match_eager_steps_on_cpu(role: str, tmp_path: Path) -> None:
    assert _compare(role, torch.float32, torch.device("cpu"), tmp_path, 1e-5) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("role", ["whole", "first", "last"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_captured_pieces_match_eager_steps_on_cuda(role: str, dtype: torch.dtype, tol: float,
                                                   tmp_path: Path) -> None:
    assert _compare(role, dtype, torch.device("cuda"), tmp_path, tol) == 5
