"""The runtime on CUDA against HF transformers on CUDA (marker `gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_worker.offline import LocalPipeline, LocalPipelineConfig
from stage_worker.step_input import SeqChunk
from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "tol"), [
    (torch.float32, 2e-3),  # TF32 is off by default for matmul in torch; SDPA kernels differ
    (torch.bfloat16, 5e-2),  # bf16 has 8 mantissa bits: relative error ~4e-3 per op
])
@pytest.mark.parametrize("variant", ["llama_gqa_untied", "qwen2_qkv_bias", "llama3_rope_scaling"])
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
