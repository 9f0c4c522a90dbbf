"""Token ids -> the text and bytes OpenAI's `logprobs` show for each token.

The router's stream carries token ids only, so the gateway reads the served model's
`tokenizer.json` (the `tokenizers` library; no torch): from `--tokenizer DIR`, else from the
model store when the router serves a model it holds (what `stagemesh serve` runs by default).
Without one, a token reads "token_id:<id>" with no bytes (vLLM's
--return-tokens-as-token-ids format), so clients can still tell tokens apart.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from tokenizers import Tokenizer, decoders

from foundation.byte_level import table_bytes

log = logging.getLogger("stagemesh.gateway")

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


class TokenTexts:
    """id -> (text, UTF-8 bytes) of one token. A token that is part of a multi-byte
    character has bytes that are not valid UTF-8 alone; its text is then "bytes:\\xNN..."
    (vLLM's convention) and its bytes are exact."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        # Byte-level BPE (GPT-2, Llama 3, SmolLM): each vocab character stands for one byte.
        self._byte_level = tokenizer is not None and isinstance(tokenizer.decoder,
                                                                decoders.ByteLevel)
        self._special = ({i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
                         if tokenizer is not None else {})
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    @classmethod
    def from_dir(cls, model_dir: Path) -> TokenTexts:
        return cls(Tokenizer.from_file(str(model_dir / "tokenizer.json")))

    @property
    def vocab_size(self) -> int | None:
        if self.tokenizer is None:
            return None
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def get(self, token_id: int) -> tuple[str, list[int] | None]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._render(token_id)
        return found

    def _render(self, token_id: int) -> tuple[str, list[int] | None]:
        raw = self._raw_bytes(token_id)
        if raw is None:
            return f"token_id:{token_id}", None
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def _raw_bytes(self, token_id: int) -> bytes | None:
        if self.tokenizer is None:
            return None
        if token_id in self._special:
            return self._special[token_id].encode("utf-8")
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        if self._byte_level and (spelled := table_bytes(piece)) is not None:
            return spelled
        if m := _BYTE_TOKEN.match(piece):
            return bytes([int(m.group(1), 16)])
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False)).encode()


def load_token_texts(explicit_dir: Path | None, store_dir: Path | None,
                     vocab_size: int) -> TokenTexts:
    """The tokenizer from `explicit_dir` (an error if unusable), else from `store_dir` when it
    holds one whose vocabulary matches the router's, else none (ids shown as text)."""
    if explicit_dir is not None:
        texts = TokenTexts.from_dir(explicit_dir)
        if texts.vocab_size != vocab_size:
            log.warning("tokenizer in %s has %s tokens, the router's model %d: token texts in "
                        "logprobs may be wrong", explicit_dir, texts.vocab_size, vocab_size)
        return texts
    if store_dir is not None and (store_dir / "tokenizer.json").is_file():
        texts = TokenTexts.from_dir(store_dir)
        if texts.vocab_size == vocab_size:
            log.info("token texts for logprobs from %s", store_dir)
            return texts
    log.info("no tokenizer for the served model: logprobs show tokens as 'token_id:<id>' "
             "(pass --tokenizer DIR to show text)")
    return TokenTexts(None)
