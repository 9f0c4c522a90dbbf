"""Tiny random HF checkpoints written by transformers itself (the reference nobody here wrote)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

BASE: dict[str, Any] = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

# Each variant covers one feature the runtime must get right.
VARIANTS: dict[str, dict[str, Any]] = {
    "llama_gqa_untied": dict(tie_word_embeddings=False),
    "llama_tied": dict(tie_word_embeddings=True),
    "llama_mha": dict(num_key_value_heads=8, tie_word_embeddings=False),
    "llama_one_kv_head": dict(num_key_value_heads=1, tie_word_embeddings=False),
    "llama3_rope_scaling": dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
    ),
    "qwen2_qkv_bias": dict(tie_word_embeddings=False, rope_theta=1000000.0),
    # head_dim 32: the shape the Triton attention kernel and the decode graphs take on.
    "llama_head_dim_32": dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
                              num_key_value_heads=2, tie_word_embeddings=False),
}


def build_tiny_model(variant: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    kwargs = {**BASE, **VARIANTS[variant]}
    if variant.startswith("qwen2"):
        model: PreTrainedModel = Qwen2ForCausalLM(Qwen2Config(**kwargs))
        # Random init leaves biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    with torch.no_grad():  # wider weights than the default init: logits far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.eval()


def write_tiny_checkpoint(variant: str, out: Path, seed: int = 0) -> PreTrainedModel:
    model = build_tiny_model(variant, seed)
    model.save_pretrained(out)
    return model
