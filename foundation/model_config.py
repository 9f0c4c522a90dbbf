"""The model's shape, read once from an HF `config.json` into a frozen dataclass."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about a Llama-family decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections.
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # Sliding-window attention (Mistral; Qwen2 with use_sliding_window): each token attends
    # to at most this many keys. The runtime has no windowed attention, so the context is
    # capped at the window (`max_position_embeddings` above is already the cap), where full
    # attention and windowed attention are the same computation; None: no window.
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.

        Raises:
            ValueError: unsupported architecture or rope type, naming the field.
        """
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope = _rope_params(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = _sliding_window(cfg, model_type)
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=max_positions if window is None
            else min(max_positions, window),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=_llama3_scaling(rope),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            sliding_window=window,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        with open(model_dir / "config.json", encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The attention window in force, or None: Mistral's `sliding_window` (null on models
    without one); Qwen2's only with `use_sliding_window` (its configs carry a window they do
    not use).

    Raises:
        ValueError: a window that is not a positive integer.
    """
    window = cfg.get("sliding_window")
    if window is None or (model_type == "qwen2" and not cfg.get("use_sliding_window")):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json sliding_window must be a positive integer or null, "
                         f"got {window!r}")
    return window


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """Merge the two spellings of rope settings into one dict.

    transformers < 5 writes `rope_theta` + `rope_scaling`; 5.x writes `rope_parameters`.
    """
    merged: dict[str, Any] = {}
    if cfg.get("rope_theta") is not None:
        merged["rope_theta"] = cfg["rope_theta"]
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), dict):
            merged.update(cfg[key])
    return merged


def _llama3_scaling(rope: dict[str, Any]) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"config.json rope_scaling.rope_type {rope_type!r} is not supported "
                         "(supported: default, llama3)")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
