"""Text prompts of an exact token count under a model's own tokenizer, for the serving
benchmarks' `--prompt-kind text` (the text path: the front tokenizes each prompt, as it does
for users, where token-id prompts skip it).

The text is the decoding of random ordinary token ids, cut at a token boundary so that
encoding it again (without special tokens, as the gateway's /v1/completions does) gives
exactly the asked length; a cut that the re-encoding merges or splits is moved until it
does. Seeded: the same generator state gives the same prompts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

FIRST_ORDINARY_ID = 100  # below: special and byte tokens of the default model
_MAX_CUTS = 64  # cuts tried before a prompt's ids are drawn again


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The model directory's `tokenizer.json`."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"--prompt-kind text needs {path.name} in the model directory "
                         f"{model_dir.name}")
    return Tokenizer.from_file(str(path))


def text_prompt(tokenizer: Tokenizer, rng: np.random.Generator, length: int) -> str:
    """A text that `tokenizer` encodes into exactly `length` tokens (no special ones)."""
    if length < 1:
        raise ValueError(f"a text prompt needs at least 1 token, got {length}")
    vocab = tokenizer.get_vocab_size()
    while True:
        ids = rng.integers(FIRST_ORDINARY_ID, vocab, 2 * length + 8).tolist()
        text = tokenizer.decode(ids)
        offsets = tokenizer.encode(text, add_special_tokens=False).offsets
        if len(offsets) <= length:
            continue  # the decoding merged into fewer tokens than asked: draw again
        cut = length
        for _ in range(_MAX_CUTS):
            head = text[:offsets[cut][0]]
            got = len(tokenizer.encode(head, add_special_tokens=False).ids)
            if got == length:
                return head
            cut += 1 if got < length else -1
            if not 0 < cut < len(offsets):
                break


def text_prompts(tokenizer: Tokenizer, rng: np.random.Generator, n: int, length: int
                 ) -> list[str]:
    """`n` prompts of `length` tokens each (see `text_prompt`)."""
    return [text_prompt(tokenizer, rng, length) for _ in range(n)]
