"""Incremental detokenization on the default model's byte-level BPE tokenizer: the streamed
deltas add up to a one-shot decode, and no delta ever carries half a character."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models

from foundation.tokenizer import ModelTokenizer
from router.detokenizer import MAX_HELD_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from tests.router.detok_helpers import push_runs

FFFD = "\ufffd"




def _stream(tok: Tokenizer, ids: Sequence[int], prompt: Sequence[int] = (),
            skip: bool = True, max_held: int | None = None) -> list[str]:
    """All deltas, the flush last."""
    d = (IncrementalDetokenizer(tok, prompt, skip) if max_held is None
         else IncrementalDetokenizer(tok, prompt, skip, max_held_tokens=max_held))
    return [d.push(t) for t in ids] + [d.flush()]



# (text, the exact deltas its tokens stream as, flush last). Multi-token characters appear
# only once their last token arrives.
EXACT = [
    ("🎉👍🏽", ["", "", "🎉", "", "", "👍", "", "", "🏽", ""]),
    ("你好世界", ["", "你", "", "好", "", "世", "", "", "界", ""]),
    ("café naïve", ["c", "af", "é", " na", "ïve", ""]),
    ("  two spaces", [" ", " two", " spaces", ""]),
    (" Sure 🎉!", [" Sure", "", "", " 🎉", "!", ""]),
]


@pytest.mark.parametrize(("text", "deltas"), EXACT)
def test_exact_deltas(model_tok: ModelTokenizer, text: str, deltas: list[str]) -> None:
    ids = model_tok.encode(text)
    assert _stream(model_tok.tokenizer, ids) == deltas
    assert "".join(deltas) == text


TEXTS = [
    "Hello, world! How are you today?",
    "🎉👍🏽 party 🎉🎉 done 👨‍👩‍👧",
    "你好世界，今天天气很好。日本語もテストします。",
    "Crème brûlée, naïve façade, Ångström, Ελληνικά, русский",
    "  leading spaces\n\tand tabs   trailing  ",
    "mixed: a🎉b你c\u00e9d 👍🏽 end",
    "x" * 3 + "😀" * 20,
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_text", ["", "User: say something\nAssistant:", "emoji 🎉"])
def test_stream_equals_decode(model_tok: ModelTokenizer, text: str, prompt_text: str) -> None:
    prompt = model_tok.encode(prompt_text) if prompt_text else []
    ids = model_tok.encode(text)
    deltas = _stream(model_tok.tokenizer, ids, prompt)
    assert "".join(deltas) == model_tok.decode(ids) == text
    assert not any(FFFD in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(model_tok: ModelTokenizer, skip: bool) -> None:
    # An <|im_end|> (id 2) in the middle of an emoji: skipped, the emoji's bytes join up.
    emoji = model_tok.encode("🎉")
    ids = [*model_tok.encode("ok "), emoji[0], 2, *emoji[1:], *model_tok.encode(" end")]
    deltas = _stream(model_tok.tokenizer, ids, skip=skip)
    want = model_tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == want
    assert ("🎉" in want) is skip and ("<|im_end|>" in want) is not skip


def test_prompt_ending_inside_a_character_does_not_leak(tok: Tokenizer) -> None:
    emoji = tok.encode("🎉", add_special_tokens=False).ids
    x = tok.encode("x", add_special_tokens=False).ids
    prompt, output = [*tok.encode("hi ", add_special_tokens=False).ids, *emoji[:2]], \
        [emoji[2], *x]
    deltas = _stream(tok, output, prompt)
    # The output's bytes alone are an orphan continuation byte then "x", as decode says.
    assert "".join(deltas) == tok.decode(output) == FFFD + "x"


def test_held_text_comes_out_at_flush(tok: Tokenizer) -> None:
    emoji = tok.encode("a🎉", add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok, [], True)
    assert [d.push(t) for t in emoji[:-1]] == ["a", "", ""]
    assert d.flush() == FFFD  # the unfinished character, as a one-shot decode gives it
    assert d.flush() == ""


class _WindowSpy:
    """A tokenizer that records the length of every id list it decodes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self.tok.get_added_tokens_decoder())


def test_each_push_decodes_a_short_window(model_tok: ModelTokenizer) -> None:
    ids = model_tok.encode(" ".join(TEXTS) * 4)
    assert len(ids) > 400
    spy = _WindowSpy(model_tok.tokenizer)
    d = IncrementalDetokenizer(spy, model_tok.encode("a long prompt " * 50), True)  # type: ignore[arg-type]
    text = "".join(d.push(t) for t in ids) + d.flush()
    assert text == model_tok.decode(ids)
    # At most: the last emitted group (<= 4 tokens of one character, or the prompt context)
    # plus the tokens of one character still held.
    assert max(spy.lengths) <= PROMPT_CONTEXT_TOKENS + 4


@pytest.mark.parametrize("token", ["ð", "ï¿½"])  # a lone lead byte; a literal U+FFFD
def test_endless_replacement_chars_still_stream(tok: Tokenizer, token: str) -> None:
    # Text that ends in U+FFFD after every token would be held forever without the split.
    tid = tok.token_to_id(token)
    assert tid is not None
    spy = _WindowSpy(tok)
    d = IncrementalDetokenizer(spy, [], True)  # type: ignore[arg-type]
    streamed = "".join(d.push(tid) for _ in range(300))
    rest = d.flush()
    assert streamed + rest == tok.decode([tid] * 300)
    assert len(rest) <= 8 and max(spy.lengths) <= 20


@pytest.mark.parametrize("skip", [True, False])
def test_repeated_eos_does_not_grow_the_window(tok: Tokenizer, skip: bool) -> None:
    # ignore_eos benchmarks: after its answer a model may sample EOS (id 2) again and again.
    ids = [*tok.encode("Done 🎉", add_special_tokens=False).ids, *[2] * 300]
    spy = _WindowSpy(tok)
    d = IncrementalDetokenizer(spy, [], skip)  # type: ignore[arg-type]
    assert "".join(d.push(t) for t in ids) + d.flush() == tok.decode(ids, skip_special_tokens=skip)
    assert max(spy.lengths) <= 4


@st.composite
def _token_ids(draw: st.DrawFn, vocab: int, byte_ids: list[int], max_size: int) -> list[int]:
    """Token ids weighted towards single bytes and special tokens, where splitting happens."""
    one = st.one_of(st.integers(0, vocab - 1), st.sampled_from(byte_ids), st.integers(0, 16))
    return draw(st.lists(one, max_size=max_size))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans(), max_held=st.sampled_from([4, 8]))
def test_random_tokens_stream_equals_decode(tok: Tokenizer, byte_ids: list[int],
                                            data: st.DataObject, skip: bool,
                                            max_held: int) -> None:
    vocab = tok.get_vocab_size()
    prompt = data.draw(_token_ids(vocab, byte_ids, 8), label="prompt")
    ids = data.draw(_token_ids(vocab, byte_ids, 60), label="output")
    deltas = _stream(tok, ids, prompt, skip, max_held)
    want = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == want
    if FFFD not in want:
        assert not any(FFFD in d for d in deltas)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans(), max_held=st.sampled_from([4, 8]))
def test_runs_of_tokens_stream_equals_decode(tok: Tokenizer, byte_ids: list[int],
                                             data: st.DataObject, skip: bool,
                                             max_held: int) -> None:
    """push_many over runs of any length (the front decodes a stream interval's tokens at
    once) gives the one-shot decode too, and never half a character."""
    vocab = tok.get_vocab_size()
    prompt = data.draw(_token_ids(vocab, byte_ids, 8), label="prompt")
    ids = data.draw(_token_ids(vocab, byte_ids, 60), label="output")
    d = IncrementalDetokenizer(tok, prompt, skip, max_held_tokens=max_held)
    deltas, i = [], 0
    while i < len(ids):
        n = data.draw(st.integers(1, 20), label="run")
        deltas.append(d.push_many(ids[i:i + n]))
        i += n
    deltas.append(d.flush())
    want = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == want
    if FFFD not in want:
        assert not any(FFFD in x for x in deltas)


def _utf8_classes(tok: Tokenizer, byte_ids: list[int]) -> tuple[list[int], list[int]]:
    """(continuation-byte tokens, lead-byte tokens), by decoding each byte token after a
    lead byte: a continuation byte joins the lead's sequence, a lead byte starts its own."""
    lead_e2 = tok.token_to_id("â")  # byte 0xE2, the lead of a 3-byte character
    assert lead_e2 is not None
    cont: list[int] = []
    lead: list[int] = []
    for i in byte_ids:
        if tok.decode([i]) != FFFD:
            continue  # ASCII
        (cont if tok.decode([lead_e2, i]).count(FFFD) == 1 else lead).append(i)
    return cont, lead


def test_seeded_byte_soup_stream_equals_decode(tok: Tokenizer, byte_ids: list[int]) -> None:
    """Long runs of lead and continuation bytes: the text ends in U+FFFD after most tokens,
    so the held text grows past max_held_tokens and is released by splitting."""
    cont, lead = _utf8_classes(tok, byte_ids)
    assert len(cont) == 64 and len(lead) > 40
    rng = random.Random(1234)
    vocab = tok.get_vocab_size()
    for _ in range(3000):
        ids = [rng.choice(cont) if r < 0.45 else rng.choice(lead) if r < 0.8
               else rng.randrange(vocab) if r < 0.9 else rng.randrange(17)
               for r in (rng.random() for _ in range(rng.randint(0, 30)))]
        prompt = [rng.choice(lead + cont) for _ in range(rng.randint(0, 3))]
        skip = rng.random() < 0.5
        deltas = _stream(tok, ids, prompt, skip, max_held=4)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), (prompt, ids)


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, as byte-level BPE vocabularies spell bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


@pytest.fixture(scope="module")
def glued_tok() -> Tokenizer:
    """Byte-level tokenizer whose ids 0-255 are the bytes, plus id 256 = bytes 89 F0: it ends
    one character and starts the next (the default vocabulary has no such token). Its
    decoding is the same as the default model's: concatenate bytes, decode UTF-8 lossily."""
    chars = _gpt2_byte_chars()
    vocab = {c: b for b, c in enumerate(chars)} | {chars[0x89] + chars[0xF0]: 256}
    t = Tokenizer(models.BPE(vocab, [(chars[0x89], chars[0xF0])]))
    t.decoder = decoders.ByteLevel()
    return t


def test_split_never_cuts_a_character_a_later_token_completed(glued_tok: Tokenizer) -> None:
    # F0 9F 8E | 89 F0 completes 🎉 and starts another character; the following lone F0s
    # keep the text ending in U+FFFD, so the held tokens pass max_held_tokens. The split
    # before id 256 would emit a U+FFFD for the "unfinished" F0 9F 8E; it must be refused.
    ids = [0xF0, 0x9F, 0x8E, 256, 0xF0, 0xF0, 0xF0, 0xF0, 0x41]
    assert glued_tok.decode(ids) == "🎉" + FFFD * 5 + "A"
    # Released by a later split, after 🎉 and the U+FFFD of the glued token's F0.
    assert _stream(glued_tok, ids, max_held=4) == \
        ["", "", "", "", "", "", "🎉" + FFFD, "", FFFD * 4 + "A", ""]


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0x80, 0xFF), st.sampled_from([0x41, 256])),
                    max_size=40),
       max_held=st.sampled_from([4, 5, 8]))
def test_glued_tokens_stream_equals_decode(glued_tok: Tokenizer, ids: list[int],
                                           max_held: int) -> None:
    assert "".join(_stream(glued_tok, ids, max_held=max_held)) == glued_tok.decode(ids)


def test_leading_space_decoders_keep_the_space_the_prompt_shows() -> None:
    # SentencePiece-style decoding drops the first token's "▁" in a one-shot decode of the
    # output alone; streamed after a prompt, the space stays (vLLM does the same).
    t = Tokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "!": 2, "<unk>": 3},
                                   unk_token="<unk>"))
    t.decoder = decoders.Metaspace()
    assert _stream(t, [1, 2], prompt=[0]) == [" world", "!", ""]
    assert _stream(t, [1, 2]) == ["world", "!", ""] and t.decode([1, 2]) == "world!"


def test_default_tokenizer_decodes_in_the_library_stream(model_tok: ModelTokenizer) -> None:
    ids = model_tok.encode(" ".join(TEXTS) * 4)
    d = IncrementalDetokenizer(model_tok.tokenizer, model_tok.encode("a prompt"), True)
    assert d.uses_decode_stream
    text = ""
    for i in range(0, len(ids), 3):
        text += d.push_many(ids[i:i + 3])
        assert d.window_tokens <= 2 * (MAX_HELD_TOKENS + 3)
    assert text + d.flush() == model_tok.decode(ids)
    assert d.uses_decode_stream


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans(), max_held=st.sampled_from([4, 8]))
def test_stream_and_python_paths_give_the_same_deltas(tok: Tokenizer, byte_ids: list[int],
                                                       data: st.DataObject, skip: bool,
                                                       max_held: int) -> None:
    """The library's DecodeStream and the Python path split a stream into the same deltas,
    the split of long held runs (a small max_held) included."""
    vocab = tok.get_vocab_size()
    prompt = data.draw(_token_ids(vocab, byte_ids, 8), label="prompt")
    ids = data.draw(_token_ids(vocab, byte_ids, 60), label="output")
    runs = data.draw(st.lists(st.integers(1, 6), min_size=len(ids), max_size=len(ids)),
                     label="runs")
    got = []
    for native in (True, False):
        d = IncrementalDetokenizer(tok, prompt, skip, max_held, decode_stream=native)
        got.append([*push_runs(d, ids, runs), d.flush()])
    assert got[0] == got[1]
    assert "".join(got[0]) == tok.decode(ids, skip_special_tokens=skip)


def test_endless_replacement_chars_keep_the_stream_window_short(tok: Tokenizer) -> None:
    tid = tok.token_to_id("ð")  # a lone lead byte: the text ends in U+FFFD after every token
    assert tid is not None
    d = IncrementalDetokenizer(tok, [], True)
    streamed = ""
    for _ in range(300):
        streamed += d.push(tid)
        assert d.window_tokens <= 2 * MAX_HELD_TOKENS
    assert streamed + d.flush() == tok.decode([tid] * 300)


class _FailingStream:
    """A DecodeStream whose window stopped starting with its prefix's decode."""

    def step(self, tokenizer: Tokenizer, ids: list[int]) -> str | None:
        raise Exception("Invalid prefix encountered")  # as the library raises it


def test_a_stream_that_fails_hands_over_to_the_python_path(model_tok: ModelTokenizer) -> None:
    ids = model_tok.encode("Streaming 🎉 goes on after the stream gives up.")
    d = IncrementalDetokenizer(model_tok.tokenizer, [], True)
    first = d.push_many(ids[:4])
    d._stream = _FailingStream()  # type: ignore[assignment]
    rest = "".join(d.push(t) for t in ids[4:]) + d.flush()
    assert not d.uses_decode_stream
    assert first + rest == model_tok.decode(ids)


@pytest.mark.parametrize("native", [True, False])
def test_runs_that_always_end_inside_a_character_still_stream(model_tok: ModelTokenizer,
                                                              native: bool) -> None:
    # 😀 is 3 tokens; after "x" every run of 3 ends inside one, so the window never ends on
    # a whole character and the text is released by splitting at an earlier boundary.
    ids = model_tok.encode("x" + "😀" * 60)
    assert len(ids) == 181
    d = IncrementalDetokenizer(model_tok.tokenizer, [], True, decode_stream=native)
    deltas = [d.push_many(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert sum(map(len, deltas[:-1])) >= 50  # streamed, not held until the last run
    assert "".join(deltas) + d.flush() == model_tok.decode(ids)
    assert d.window_tokens <= 2 * (MAX_HELD_TOKENS + 3)
