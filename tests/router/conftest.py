"""The default model's tokenizer for the detokenizer tests (a module that needs another
tokenizer defines its own fixture of the same name)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from foundation.tokenizer import ModelTokenizer
from tests.default_model import default_model_dir


@pytest.fixture(scope="session")
def model_tok() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="session")
def tok(model_tok: ModelTokenizer) -> Tokenizer:
    return model_tok.tokenizer


@pytest.fixture(scope="session")
def byte_ids(tok: Tokenizer) -> list[int]:
    """Tokens of one byte-level character, i.e. one raw byte: 0x80-0xBF are continuation
    bytes, 0xC0-0xFF lead bytes. These are what split a character across tokens."""
    return sorted(i for t, i in tok.get_vocab().items() if len(t) == 1)
