"""The real default model as imported into stagemesh_home() (scripts/test.sh fetches it first).

Checks the files the rest of stagemesh reads without transformers (config.json,
model.safetensors, tokenizer.json + the chat template in tokenizer_config.json) against what
transformers does with the same directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2.sandbox
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from foundation.modelstore import check_weights, fetch_default_model, read_config, resolve_model

pytestmark = pytest.mark.slow  # model-sized; still part of the normal suite

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The chat prompt's ids, as transformers' GGUF tokenizer produced them before the import.
QUESTION_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520,
    9531, 198,
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    fetch_default_model()  # returns at once when the test script already fetched it
    return resolve_model("default")


def render_chat(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids as our router builds them: jinja2 + tokenizers, no transformers."""
    config: dict[str, Any] = json.loads((model_dir / "tokenizer_config.json").read_text())
    # The environment transformers renders chat templates with.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    text = env.from_string(config["chat_template"]).render(
        messages=messages, add_generation_prompt=True,
        bos_token=config["bos_token"], eos_token=config["eos_token"],
    )
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def test_config(model_dir: Path) -> None:
    config = read_config(model_dir)
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) \
        == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rope_scaling"] is None
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert "quantization_config" not in config
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_weights_are_fp32_without_lm_head(model_dir: Path) -> None:
    located = check_weights(model_dir)
    assert len(located) == 272  # 30 layers x 9 + embedding + final norm
    assert "lm_head.weight" not in located  # tied to model.embed_tokens.weight
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as weights:
        embed = weights.get_slice("model.embed_tokens.weight")
        assert (embed.get_dtype(), embed.get_shape()) == ("F32", [49152, 576])
        names: list[str] = weights.keys()  # a safe_open handle is not iterable
        assert {weights.get_slice(name).get_dtype() for name in names} == {"F32"}


def test_tokenizer_config_is_self_contained(model_dir: Path) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["add_bos_token"] is False
    assert not (model_dir / "chat_template.jinja").exists()


def test_chat_prompt_ids_match_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = render_chat(model_dir, QUESTION)
    theirs = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours == list(theirs) == QUESTION_IDS


def test_greedy_answer(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    prompt = torch.tensor([QUESTION_IDS])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                             do_sample=False)
    answer = tokenizer.decode(out[0, len(QUESTION_IDS):], skip_special_tokens=True)
    assert answer == "The capital of France is Paris."
