"""Byte-level tables against the `tokenizers` library's own decode, which nobody here wrote:
a token id's bytes, joined and decoded lossily, are `tokenizer.decode` for any ids."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from foundation.byte_level import byte_level_tables, byte_of_char
from foundation.tokenizer import ModelTokenizer
from tests.default_model import default_model_dir


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return ModelTokenizer.from_dir(default_model_dir()).tokenizer


def _decode(table: tuple[bytes, ...], ids: list[int]) -> str:
    return b"".join(table[i] for i in ids).decode("utf-8", "replace")


def test_every_id_decodes_as_the_library_decodes_it(tok: Tokenizer) -> None:
    tables = byte_level_tables(tok)
    assert tables is not None
    size = tok.get_vocab_size(with_added_tokens=True)
    assert len(tables.full) == len(tables.skipping) == size
    ids = list(range(size))
    random.Random(7).shuffle(ids)
    # Every id, in runs of 48 (runs join bytes across tokens, some into whole characters).
    for start in range(0, size, 48):
        run = ids[start:start + 48]
        for skip, table in ((False, tables.full), (True, tables.skipping)):
            assert _decode(table, run) == tok.decode(run, skip_special_tokens=skip), run


def test_byte_soup_and_special_tokens_decode_as_the_library_does(tok: Tokenizer) -> None:
    tables = byte_level_tables(tok)
    assert tables is not None
    single_bytes = sorted(i for t, i in tok.get_vocab().items() if len(t) == 1)
    rng = random.Random(11)
    size = tok.get_vocab_size()
    for _ in range(3000):
        ids = [rng.choice(single_bytes) if r < 0.6 else rng.randrange(17) if r < 0.75
               else rng.randrange(size) for r in (rng.random() for _ in range(rng.randint(1, 40)))]
        for skip, table in ((False, tables.full), (True, tables.skipping)):
            assert _decode(table, ids) == tok.decode(ids, skip_special_tokens=skip), ids


def test_specials_are_empty_only_when_skipped(tok: Tokenizer) -> None:
    tables = byte_level_tables(tok)
    assert tables is not None
    assert tables.full[2] == b"<|im_end|>" and tables.skipping[2] == b""
    hello = tok.token_to_id("Hello")
    assert tables.full[hello] == tables.skipping[hello] == b"Hello"


def test_the_gpt2_table_spells_every_byte_once() -> None:
    table = byte_of_char()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["A"] == 0x41 and table["Ċ"] == 0x0A


def test_other_decoders_get_no_table() -> None:
    t = Tokenizer(models.WordLevel({"▁hello": 0, "<unk>": 1}, unk_token="<unk>"))
    t.decoder = decoders.Metaspace()
    assert byte_level_tables(t) is None
    assert byte_level_tables(Tokenizer(models.WordLevel({"a": 0, "<unk>": 1},
                                                        unk_token="<unk>"))) is None


def test_an_added_token_the_decoder_would_change_gets_no_table() -> None:
    # "é" spells byte 0xE9 in GPT-2's table: through the ByteLevel decoder it would be a
    # lone byte, as literal text a character. The rule cannot tell which the library does.
    def byte_tokenizer() -> Tokenizer:
        t = Tokenizer(models.BPE(dict(byte_of_char()), []))
        t.decoder = decoders.ByteLevel()
        return t

    assert byte_level_tables(byte_tokenizer()) is not None
    t = byte_tokenizer()
    t.add_tokens([AddedToken("é", special=False)])
    assert byte_level_tables(t) is None


@pytest.mark.parametrize("skip", [True, False])
def test_an_added_token_outside_the_table_keeps_its_text(skip: bool) -> None:
    # DeepSeek-style special tokens use characters GPT-2's table lacks ("｜", "▁"): the
    # decoder keeps their UTF-8, between bytes of other tokens.
    chars = byte_of_char()
    t = Tokenizer(models.BPE(dict(chars), []))
    t.decoder = decoders.ByteLevel()
    t.add_tokens([AddedToken("<｜end▁of▁text｜>", special=True),
                  AddedToken("plain words", special=False)])
    tables = byte_level_tables(t)
    assert tables is not None
    end, plain = t.token_to_id("<｜end▁of▁text｜>"), t.token_to_id("plain words")
    byte = {b: i for i, b in enumerate(chars.values())}  # byte -> its token id here
    rng = random.Random(3)
    for _ in range(500):
        ids = [rng.choice([end, plain, byte[0xF0], byte[0x9F], byte[0x8E], byte[0x89],
                           rng.randrange(256)]) for _ in range(rng.randint(1, 12))]
        table = tables.skipping if skip else tables.full
        assert _decode(table, ids) == t.decode(ids, skip_special_tokens=skip), ids
