"""ModelConfig from HF config.json dicts: sliding windows cap the context (the runtime has
no windowed attention, and up to the window windowed and full attention are the same)."""

from __future__ import annotations

from typing import Any

import pytest

from foundation.model_config import ModelConfig

BASE: dict[str, Any] = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "max_position_embeddings": 32768}


def test_a_mistral_window_caps_the_context() -> None:
    cfg = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": 4096})
    assert cfg.sliding_window == 4096 and cfg.max_position_embeddings == 4096
    wide = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral",
                                     "sliding_window": 65536})
    assert wide.max_position_embeddings == 32768  # a window past the context changes nothing
    none = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": None})
    assert none.sliding_window is None and none.max_position_embeddings == 32768


def test_qwen2_window_only_when_used() -> None:
    unused = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "sliding_window": 4096,
                                       "use_sliding_window": False})
    assert unused.sliding_window is None and unused.max_position_embeddings == 32768
    used = ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "sliding_window": 4096,
                                     "use_sliding_window": True})
    assert used.max_position_embeddings == 4096


@pytest.mark.parametrize("window", [0, -5, "4096", True, 1.5])
def test_a_bad_window_names_the_field(window: object) -> None:
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": window})


def test_unsupported_architectures_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="model_type 'gemma' is not supported"):
        ModelConfig.from_hf_dict({**BASE, "model_type": "gemma"})
