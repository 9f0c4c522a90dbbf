"""The model shapes of the benchmark protocol (random seeded weights, real shapes)."""

from __future__ import annotations

from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-5,
    ),
    "llama3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
}
