"""`kv_cache_dtype="fp8"`: the stage's KV pool in e4m3 (twice the blocks in the same bytes),
its steps close to the 16/32-bit pool's, block copies that move the stored bytes, and the
config's check of the flag (`serve` passing it on: tests/stagemesh/test_cli.py). The kernels'
own fp8 checks are in tests/kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.fp8_format import FP8
from stage_worker.config import StageConfig
from stage_worker.offline import LocalPipeline, LocalPipelineConfig
from stage_worker.runner import StageRunner, StageRunnerConfig
from stage_worker.step_input import SeqChunk
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint


def test_an_fp8_pool_holds_twice_the_blocks_and_stays_close(tmp_path: Path) -> None:
    from foundation.model_config import ModelConfig
    from stage_worker.partition import partition_layers

    write_tiny_checkpoint("llama_gqa_untied", tmp_path)
    model_cfg = ModelConfig.from_dir(tmp_path)
    layers = partition_layers(model_cfg.num_layers, 1, None)[0]
    runners = {kv: StageRunner(StageRunnerConfig(tmp_path, layers, torch.float32,
                                                 torch.device("cpu"), block_size=8,
                                                 kv_cache_bytes=1 << 20, kv_cache_dtype=kv),
                               model_cfg)
               for kv in ("auto", "fp8")}
    assert runners["auto"].kv.cache.dtype == torch.float32
    assert runners["fp8"].kv.cache.dtype == FP8
    assert runners["fp8"].num_blocks == 4 * runners["auto"].num_blocks  # 1 byte against 4
    # A prompt of 20 tokens, then 4 decode steps, the same ids on both pools.
    ids = torch.randint(0, model_cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    logits: dict[str, list[torch.Tensor]] = {}
    for kv, runner in runners.items():
        steps = [runner.execute([SeqChunk(0, 0, 20, [0, 1, 2])], ids[:20])]
        steps += [runner.execute([SeqChunk(0, p, 1, [0, 1, 2])], ids[p:p + 1])
                  for p in range(20, 24)]
        logits[kv] = steps
    for got, want in zip(logits["fp8"], logits["auto"], strict=True):
        rel = ((got - want).norm() / want.norm()).item()
        assert 0 < rel < 0.05, rel  # e4m3 K/V: not exact, and close
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_block_copies_move_the_stored_bytes(tmp_path: Path) -> None:
    write_tiny_checkpoint("llama_gqa_untied", tmp_path)
    pipe = LocalPipeline(LocalPipelineConfig(tmp_path, 2, block_size=8, num_blocks=8,
                                             kv_cache_dtype="fp8"))
    ids = torch.arange(10, 30)
    pipe.step([SeqChunk(0, 0, 20, [0, 1, 2])], ids)
    for stage in pipe.stages:
        raw = stage.kv.cache.view(torch.uint8)
        assert raw[:, :, 1].any(), "the prompt's K/V were written"
        stage.copy_blocks([(1, 5), (2, 6)])
        assert torch.equal(raw[:, :, 5], raw[:, :, 1])
        assert torch.equal(raw[:, :, 6], raw[:, :, 2])



def test_the_config_refuses_an_unknown_kv_cache_dtype(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, got 'fp16'"):
        StageConfig(model_dir=tmp_path, kv_cache_dtype="fp16")
