"""Tiny model directories in Hugging Face layout, built in tmp_path (no torch, no network),
and the fixtures that build them (re-exported by the conftests that use them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

TINY_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "vocab_size": 4,
}


def tiny_tensors() -> dict[str, np.ndarray]:
    """Ten small float32 tensors named like a 2-layer Llama."""
    rng = np.random.default_rng(0)
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for layer in range(2):
        names += [f"model.layers.{layer}.{part}.weight" for part in
                  ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj", "input_layernorm")]
    return {name: rng.standard_normal((4, 8)).astype(np.float32) for name in names}


def write_tiny_model(root: Path, shards: int = 1) -> Path:
    """Writes config, weights (one file, or `shards` files + index) and tokenizer.json."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(TINY_CONFIG))
    tensors = tiny_tensors()
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"))
    else:
        names = sorted(tensors)
        weight_map = {}
        for i in range(shards):
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_file(part, str(root / shard))
            weight_map.update(dict.fromkeys(part, shard))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "!": 3},
                                    unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(root / "tokenizer.json"))
    return root


def truncate(path: Path, n_bytes: int) -> tuple[int, int]:
    """Cuts `n_bytes` off the end of `path`; returns (old size, new size)."""
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size - n_bytes)
    return size, size - n_bytes


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny")


@pytest.fixture
def sharded_model(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "sharded", shards=3)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty STAGEMESH_HOME for this test."""
    path = tmp_path / "home"
    monkeypatch.setenv("STAGEMESH_HOME", str(path))
    yield path
