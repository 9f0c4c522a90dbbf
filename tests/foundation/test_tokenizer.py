"""The torch-free tokenizer + chat template against HF transformers' own rendering."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from foundation.tokenizer import ChatTemplateError, ModelTokenizer
from tests.default_model import QUESTIONS, default_model_dir

CONVERSATIONS = [
    [{"role": "user", "content": q}] for q in QUESTIONS[:4]
] + [
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Hi there ✨ 你好"},
     {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Tell me a joke."}],
]


@pytest.fixture(scope="module")
def ours() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def hf() -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(ours: ModelTokenizer, hf: AutoTokenizer,
                                            messages: list[dict[str, str]]) -> None:
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == want
    want_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
    assert ours.encode_chat(messages) == list(want_ids)


@pytest.mark.parametrize("text", ["Hello world", "  spaces  and\nnewlines", "émoji 🎉 and 中文"])
def test_encode_decode_match_transformers(ours: ModelTokenizer, hf: AutoTokenizer,
                                          text: str) -> None:
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"],
                                                       skip_special_tokens=True)


def test_special_tokens(ours: ModelTokenizer) -> None:
    assert ours.special.eos == "<|im_end|>"
    assert 2 in ours.special.eos_ids
    assert ours.vocab_size == 49152


def test_template_errors_are_typed(ours: ModelTokenizer) -> None:
    bare = ModelTokenizer(ours.tokenizer, {}, [])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "x"}])
    strict = ModelTokenizer(ours.tokenizer, {
        "chat_template": "{% if messages[0]['role'] != 'user' %}"
                         "{{ raise_exception('first message must be from the user') }}{% endif %}"
    }, [])
    with pytest.raises(ChatTemplateError, match="must be from the user"):
        strict.render_chat([{"role": "assistant", "content": "x"}])
