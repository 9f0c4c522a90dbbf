"""The byte-level detokenizer against `tokenizers`' one-shot decode: its deltas add up to the
decode of the output alone, text once emitted is never taken back (no delta ends inside a
character), and it is the detokenizer byte-level tokenizers get."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from foundation.byte_level import byte_level_tables, byte_of_char
from foundation.tokenizer import ModelTokenizer
from router.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer, make_detokenizer
from tests.router.detok_helpers import push_runs

FFFD = "\ufffd"





def _check_stream(tok: Tokenizer, ids: list[int], runs: list[int], skip: bool) -> list[str]:
    """Push `ids` in runs of the given lengths; the deltas (flush last), checked."""
    d = make_detokenizer(tok, [], skip)
    assert isinstance(d, ByteLevelDetokenizer)
    want = tok.decode(ids, skip_special_tokens=skip)
    deltas = [*push_runs(d, ids, runs), d.flush()]
    assert d.flush() == ""
    assert "".join(deltas) == want
    emitted = ""
    for delta in deltas:  # emitted text is final: a prefix of the whole decode
        emitted += delta
        assert want.startswith(emitted)
    if FFFD not in want:
        assert not any(FFFD in x for x in deltas)
    return deltas


def test_byte_level_tokenizers_get_the_byte_path(model_tok: ModelTokenizer) -> None:
    assert isinstance(make_detokenizer(model_tok.tokenizer, [1, 2], True), ByteLevelDetokenizer)
    t = Tokenizer(models.WordLevel({"▁hello": 0, "<unk>": 1}, unk_token="<unk>"))
    t.decoder = decoders.Metaspace()
    assert isinstance(make_detokenizer(t, [0], True), IncrementalDetokenizer)


@pytest.mark.parametrize(("text", "deltas"), [
    ("🎉👍🏽", ["", "", "🎉", "", "", "👍", "", "", "🏽", ""]),
    ("你好世界", ["", "你", "", "好", "", "世", "", "", "界", ""]),
    ("café naïve", ["c", "af", "é", " na", "ïve", ""]),
    # The space before the emoji is whole at once; the emoji comes with its last token.
    (" Sure 🎉!", [" Sure", " ", "", "🎉", "!", ""]),
])
def test_exact_deltas(model_tok: ModelTokenizer, text: str, deltas: list[str]) -> None:
    ids = model_tok.encode(text)
    assert _check_stream(model_tok.tokenizer, ids, [1] * len(ids), True) == deltas


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(model_tok: ModelTokenizer, skip: bool) -> None:
    emoji = model_tok.encode("🎉")
    ids = [*model_tok.encode("ok "), emoji[0], 2, *emoji[1:], *model_tok.encode(" end")]
    text = "".join(_check_stream(model_tok.tokenizer, ids, [1] * len(ids), skip))
    assert ("🎉" in text) is skip and ("<|im_end|>" in text) is not skip


def test_unfinished_character_comes_out_at_flush(tok: Tokenizer) -> None:
    ids = tok.encode("a🎉", add_special_tokens=False).ids
    d = make_detokenizer(tok, [], True)
    assert [d.push(t) for t in ids[:-1]] == ["a", "", ""]
    assert d.flush() == FFFD and d.flush() == ""


def test_ids_past_the_vocabulary_decode_to_nothing(tok: Tokenizer) -> None:
    size = tok.get_vocab_size(with_added_tokens=True)
    hello = tok.token_to_id("Hello")
    d = make_detokenizer(tok, [], True)
    assert d.push_many([hello, size + 3, hello]) == tok.decode([hello, size + 3, hello])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_random_runs_stream_equals_decode(tok: Tokenizer, byte_ids: list[int],
                                          data: st.DataObject, skip: bool) -> None:
    vocab = tok.get_vocab_size()
    one = st.one_of(st.integers(0, vocab - 1), st.sampled_from(byte_ids), st.integers(0, 16))
    ids = data.draw(st.lists(one, max_size=60), label="ids")
    runs = data.draw(st.lists(st.integers(1, 20), min_size=len(ids), max_size=len(ids)),
                     label="runs")
    _check_stream(tok, ids, runs, skip)


@pytest.fixture(scope="module")
def glued_tok() -> Tokenizer:
    """Ids 0-255 are the bytes, 256 is bytes 89 F0: it ends one character and starts the
    next (the default vocabulary has no such token)."""
    chars = {b: c for c, b in byte_of_char().items()}
    vocab = {c: b for b, c in chars.items()} | {chars[0x89] + chars[0xF0]: 256}
    glued = Tokenizer(models.BPE(vocab, [(chars[0x89], chars[0xF0])]))
    glued.decoder = decoders.ByteLevel()
    assert byte_level_tables(glued) is not None
    return glued


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0x80, 0xFF), st.sampled_from([0x41, 256])),
                    max_size=40),
       runs=st.lists(st.integers(1, 5), min_size=40, max_size=40))
def test_a_token_that_ends_one_character_and_starts_the_next(glued_tok: Tokenizer,
                                                            ids: list[int],
                                                            runs: list[int]) -> None:
    # The byte path joins bytes across tokens whatever their boundaries.
    _check_stream(glued_tok, ids, runs, True)
