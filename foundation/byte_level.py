"""Byte-level BPE (GPT-2, Llama 3, SmolLM2): each token id stands for a fixed run of bytes.

A byte-level vocabulary spells every byte as one printable character (GPT-2's table), and
the `tokenizers` library's ByteLevel decoder turns a list of tokens back into text by
mapping each token's characters to their bytes (a token with a character outside the table
keeps its UTF-8 bytes), concatenating them and decoding UTF-8 lossily. So a token's bytes do
not depend on its neighbours, and for such a tokenizer

    tokenizer.decode(ids, skip_special_tokens=s) == b"".join(table[i] for i in ids).decode(
        "utf-8", "replace")

with `table` = `ByteLevelTables.skipping` (s) or `.full`: a lookup and a join in place of
the library's decode, and, with an incremental UTF-8 decoder, text deltas that never end
inside a character (`router.detokenizer.ByteLevelDetokenizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from tokenizers import Tokenizer, decoders


@cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's table, character -> the byte it spells: printable Latin-1 bytes are their own
    character; the others (controls, space, 0x7F-0xA0, 0xAD) are U+0100 onwards, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def table_bytes(piece: str) -> bytes | None:
    """Each character's byte of one token's string, or None if some character is not in
    the table (an added token's text)."""
    table = byte_of_char()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


def piece_bytes(piece: str) -> bytes:
    """The bytes a byte-level decoder makes of one token's string: `table_bytes`, or its
    UTF-8 where some character is not in the table."""
    spelled = table_bytes(piece)
    return spelled if spelled is not None else piece.encode("utf-8")


@dataclass(frozen=True)
class ByteLevelTables:
    """Token id -> bytes, for every id below the tokenizer's size (added tokens included).

    full: each id's bytes (an id the vocabulary lacks: none), as decode sees it with
        `skip_special_tokens=False`.
    skipping: the same with every special token's bytes empty, as decode drops them with
        `skip_special_tokens=True`.
    """

    full: tuple[bytes, ...]
    skipping: tuple[bytes, ...]


@cache
def byte_level_tables(tokenizer: Tokenizer) -> ByteLevelTables | None:
    """The tables of `tokenizer` (built once per tokenizer object, which is not changed
    once loaded: about 50 ms for 49k tokens), or None unless its decoder is ByteLevel alone
    and every added token decodes to the same bytes whether or not it went through that
    decoder (its text is ASCII without spaces or controls, or has a character outside the
    table): then the id -> bytes rule above is the library's decode exactly."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    added = tokenizer.get_added_tokens_decoder()
    if any(piece_bytes(t.content) != t.content.encode("utf-8") for t in added.values()):
        return None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    full = [b""] * size
    for i in range(size):
        piece = tokenizer.id_to_token(i)
        if piece is not None:
            full[i] = piece_bytes(piece)
    skipping = list(full)
    for i, token in added.items():
        if token.special and i < size:
            skipping[i] = b""
    return ByteLevelTables(tuple(full), tuple(skipping))
