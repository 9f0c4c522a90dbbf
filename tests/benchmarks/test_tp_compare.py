"""The TP comparison's verdicts: which prompts match the baseline's greedy tokens, where the
others first differ, and how far the log probabilities of the shared prefix drift; and the
bytes its roofline counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.tp_compare import compare, kv_bytes, weight_bytes
from foundation.model_config import ModelConfig


def _run(ids: list[int], logprobs: list[float]) -> dict[str, list]:
    return {"token_ids": ids, "logprobs": logprobs}


def test_compare_counts_identical_prompts_and_drift_up_to_the_first_difference() -> None:
    base = [_run([1, 2, 3], [-0.5, -1.0, -2.0]), _run([4, 5, 6], [-0.1, -0.2, -0.3])]
    other = [_run([1, 2, 3], [-0.5, -1.25, -2.0]),  # same tokens, one logprob off by 0.25
             _run([4, 9, 6], [-0.125, -7.0, -0.3])]  # differs at 1: only position 0 counts
    got = compare(base, other)
    assert got == {"prompts_identical": 1, "prompts": 2, "first_difference": [None, 1],
                   "max_abs_logprob_diff": 0.25}
    assert compare(base, base)["max_abs_logprob_diff"] == 0.0


def test_compare_treats_a_shorter_run_as_differing_where_it_ends() -> None:
    got = compare([_run([1, 2, 3], [0.0] * 3)], [_run([1, 2], [0.0] * 2)])
    assert got["prompts_identical"] == 0 and got["first_difference"] == [2]


def test_weight_bytes_leave_out_an_untied_embedding(tmp_path: Path) -> None:
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4, dtype=torch.bfloat16),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(10, 4, dtype=torch.float32)},
              str(tmp_path / "model.safetensors"))
    assert weight_bytes(tmp_path, tied=False) == 8 * 4 * 2 + 10 * 4 * 4
    assert weight_bytes(tmp_path, tied=True) == 10 * 4 * 2 + 8 * 4 * 2 + 10 * 4 * 4


@pytest.mark.parametrize("context", [1, 512])
def test_kv_bytes_are_bf16_k_and_v_of_every_layer(context: int) -> None:
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192})
    assert kv_bytes(cfg, context) == 2 * 32 * 8 * 128 * context * 2  # 128 KiB per token
