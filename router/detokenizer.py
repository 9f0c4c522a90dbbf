"""Incremental detokenization: output token ids in, text deltas out, a token (or a run of
tokens) at a time.

The prefix/read-offset technique (TGI, vLLM). The detokenizer keeps only a short window of
tokens: the group it emitted last (the "prefix", `_tokens[:_read]`), then the tokens it holds.
Each push decodes the window and emits what it adds to the prefix's own decode. Decoding the
new tokens together with the prefix makes context-dependent decoding (a leading space the
decoder strips from a first token, bytes joined across tokens) come out the same in both
decodes; decoding only the window makes a push O(window), not O(output length).

Never half a character: a byte-level BPE token can carry part of a UTF-8 character (an emoji
is often 3-4 tokens), and a window that ends inside a character decodes to a trailing
U+FFFD. While the window's text ends with U+FFFD the delta is held back; it is emitted once
the character completes (or at `flush`, if it never does).

Guarantee (tested on the default model's byte-level BPE tokenizer, for any token ids): the
concatenation of all deltas and `flush()` equals `tokenizer.decode(output_ids,
skip_special_tokens=...)`. The prompt's last tokens are the first prefix, unless the prompt
ends inside a character: then the output's first bytes would complete a prompt character, so
no context is used. For decoders that strip the first token's leading space (SentencePiece
"▁"), the stream keeps the space that the prompt context shows, as vLLM does; a one-shot
decode of the output alone drops it.

The decodes run in the tokenizers library's `DecodeStream` where it can: the same technique
over the same window (`_tokens` mirrors its state), one native call a push instead of two
decodes and the Python around them. The rare paths (`flush`, the split of a long held run)
decode here from the mirrored window; where the stream cannot follow (a tokenizer object
that is not a `tokenizers.Tokenizer`, a library whose stream steps one id at a time, a
window whose decode no longer starts with the prefix's, a prefix whose decode ends in
U+FFFD) the detokenizer goes on in Python from the same state. The deltas are the same
either way.

A byte-level tokenizer (GPT-2, Llama 3, SmolLM2; `foundation.byte_level`) needs none of
this: a token's bytes do not depend on its neighbours, so `ByteLevelDetokenizer` looks each
token's bytes up and feeds them to an incremental UTF-8 decoder, about a tenth of a
`DecodeStream` step's cost. `make_detokenizer` picks it wherever it applies.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from foundation.byte_level import byte_level_tables

REPLACEMENT = "\ufffd"

# Tokens of prompt context for the first decode (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_
# OFFSET): enough for a decoder's context-dependent first token, small enough to be cheap.
PROMPT_CONTEXT_TOKENS = 5

# Held tokens beyond which a push looks for a safe split inside the held text (see
# `_release_settled`). Longer than any UTF-8 character (4 bytes, each token >= 1 byte), so
# normal text never gets there; it bounds the window when the model emits a long run of
# invalid bytes or literal U+FFFD characters, which would otherwise hold the stream forever
# and make each push O(run length).
MAX_HELD_TOKENS = 8

# A UTF-8 sequence needs at most this many bytes after its first byte: once that many bytes
# follow an unfinished sequence, it can never complete, and the text before is settled.
_MAX_CONTINUATION_BYTES = 3


class IncrementalDetokenizer:
    """Text deltas of one output sequence.

    Args:
        tokenizer: the model's `tokenizers.Tokenizer`.
        prompt_token_ids: the prompt; only its last few tokens are kept, as context.
        skip_special_tokens: drop special tokens from the text (as `Tokenizer.decode`).
        max_held_tokens: see MAX_HELD_TOKENS (tests lower it to exercise the split); at
            least 4, the tokens one character can span.
        decode_stream: decode in the library's `DecodeStream` where it can (see the module's
            docstring); False keeps every decode on the Python path (the same deltas).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True,
                 max_held_tokens: int = MAX_HELD_TOKENS, decode_stream: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._max_held = max(max_held_tokens, _MAX_CONTINUATION_BYTES + 1)
        # Ids that `decode(..., skip_special_tokens=True)` drops before decoding: never put
        # in the window (EOS over and over under ignore_eos must not pile up there).
        self._dropped = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        ) if skip_special_tokens else frozenset()
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        text = self._decode(context)
        if not text or text.endswith(REPLACEMENT):
            # The prompt ends inside a character (or on an undecodable byte): using it as
            # context would let the output's first bytes complete a prompt character. A
            # context that decodes to nothing (skipped special tokens) adds nothing.
            context, text = [], ""
        # Invariant: _tokens is [prefix | held]; _read = len(prefix); the prefix's decode is
        # settled: no token pushed later changes it, so the window's decode always starts
        # with it. _text is that decode, or None until a Python path needs it (the stream
        # keeps its own).
        self._tokens = context
        self._read = len(context)
        self._text: str | None = text
        self._stream = self._open_stream() if decode_stream else None

    @property
    def uses_decode_stream(self) -> bool:
        """Whether pushes decode in the library's `DecodeStream` (else on the Python path)."""
        return self._stream is not None

    @property
    def window_tokens(self) -> int:
        """Tokens in the decode window: the prefix and the held tokens."""
        return len(self._tokens)

    def push(self, token_id: int) -> str:
        """Append one output token; return the text that is now final (maybe "")."""
        return self.push_many((token_id,))

    def push_many(self, token_ids: Sequence[int]) -> str:
        """Append output tokens (in order) with one decode of the window; return the text
        that is now final (maybe ""). The same text, over a stream, as pushing them one by
        one: only the split into deltas can differ."""
        dropped = self._dropped
        kept = [t for t in token_ids if t not in dropped] if dropped else list(token_ids)
        if not kept:
            return ""
        self._tokens += kept
        if self._stream is not None:
            try:
                text = self._stream.step(self._tokenizer, kept)
            except Exception:  # the window's decode no longer starts with the prefix's
                self._stream = None
            else:
                if text is not None:  # the stream advanced: its window is the held tokens
                    del self._tokens[:self._read]
                    self._read, self._text = len(self._tokens), None
                    return str(text)
                if len(self._tokens) - self._read <= self._max_held:
                    return ""
                delta = self._release_settled(self._decode(self._tokens))
                if delta:  # the split moved the prefix: restart the stream from it
                    self._stream = self._open_stream()
                return delta
        window = self._decode(self._tokens)
        if len(window) > len(self._prefix_text()) and not window.endswith(REPLACEMENT):
            return self._advance(len(self._tokens), window)
        if len(self._tokens) - self._read > self._max_held:
            return self._release_settled(window)
        return ""

    def flush(self) -> str:
        """At finish: everything not yet emitted, even an unfinished character (as U+FFFD,
        the same text a one-shot decode gives)."""
        return self._advance(len(self._tokens), self._decode(self._tokens))

    def _release_settled(self, window: str) -> str:
        """Emit the held text up to a token boundary that later tokens cannot change.

        A boundary is settled when at least _MAX_CONTINUATION_BYTES bytes follow it: a
        character still unfinished there can no longer complete. Every decoded character
        comes from at least one byte (a skipped special token adds none), so counting the
        characters after it bounds those bytes from below.

        The split must also add text. The last boundary may cut an invalid sequence whose
        one-shot decode takes a few continuation bytes after it into one U+FFFD (already
        emitted); those bytes add no text. A split that adds text lies past them, so the
        next window, which starts at the last boundary and decodes them as separate U+FFFDs,
        agrees with a one-shot decode on everything after the split.

        A boundary inside a character that the window completes is not a split: the head's
        decode ends in U+FFFD where the window's has the character. The boundaries before it
        are tried (runs of tokens that always end inside a character, as a stream interval
        of 2 over two-token characters gives, would otherwise hold the text for good).
        """
        for split in range(len(self._tokens) - 1, self._read, -1):
            if len(self._decode(self._tokens[split:])) < _MAX_CONTINUATION_BYTES:
                continue
            head = self._decode(self._tokens[:split])
            if len(head) <= len(self._prefix_text()):
                return ""  # an earlier boundary adds no more text
            if window.startswith(head):
                return self._advance(split, head)
        return ""

    def _advance(self, read: int, text: str) -> str:
        """Emit `text` (the decode of _tokens[:read]) past the prefix's text; the tokens up to
        `read` past the old prefix become the new prefix."""
        delta = text[len(self._prefix_text()):]
        del self._tokens[:self._read]
        self._read = read - self._read
        self._text = self._decode(self._tokens[:self._read])
        return delta

    def _prefix_text(self) -> str:
        """The decode of the prefix (computed here once the stream has moved it)."""
        if self._text is None:
            self._text = self._decode(self._tokens[:self._read])
        return self._text

    def _open_stream(self) -> DecodeStream | None:
        """A `DecodeStream` in this detokenizer's state (the prefix stepped in, then the held
        tokens), or None where the stream cannot hold that state: a tokenizer object it
        does not take, a library whose streams step one id at a time, a prefix whose decode
        is empty or ends in U+FFFD (the stream would not take it as its prefix)."""
        if not isinstance(self._tokenizer, Tokenizer):
            return None
        stream = DecodeStream(skip_special_tokens=self._skip_special)
        prefix, held = self._tokens[:self._read], self._tokens[self._read:]
        try:
            if prefix and stream.step(self._tokenizer, prefix) is None:
                return None
            if held and stream.step(self._tokenizer, held) is not None:
                return None  # never: the held tokens' text is incomplete, or it was emitted
        except Exception:  # an older library: a step takes one id, not a list
            return None
        return stream

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))


class ByteLevelDetokenizer:
    """Text deltas of one output sequence of a byte-level tokenizer (see
    `foundation.byte_level`): each token's bytes from a table, through an incremental UTF-8
    decoder. The same interface as `IncrementalDetokenizer`, at a table lookup a token.

    The decoder holds back the bytes of a character not yet complete (at most 3), so no
    delta ends inside a character, and replaces an invalid byte as soon as it is one; the
    deltas and `flush()` together are `tokenizer.decode(output_ids, skip_special_tokens)`.
    No prompt context is needed: a token's bytes do not depend on its neighbours, and a
    prompt that ends inside a character contributes nothing to the output's text (its
    first bytes decode alone, as `IncrementalDetokenizer` decodes them). Where the deltas
    split differs from `IncrementalDetokenizer`'s (a space before an emoji comes out at
    once, not with the emoji), the text does not.
    """

    def __init__(self, table: tuple[bytes, ...]) -> None:
        self._table = table
        self._lookup = table.__getitem__
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        """Append one output token; return the text that is now final (maybe "")."""
        return self.push_many((token_id,))

    def push_many(self, token_ids: Sequence[int]) -> str:
        """Append output tokens (in order); return the text that is now final (maybe "")."""
        try:
            data = b"".join(map(self._lookup, token_ids))
        except IndexError:  # an id past the tokenizer's vocabulary decodes to nothing
            size = len(self._table)
            data = b"".join(self._table[i] for i in token_ids if 0 <= i < size)
        return str(self._utf8.decode(data))

    def flush(self) -> str:
        """At finish: the bytes of an unfinished character, as U+FFFD (a one-shot decode's
        text); "" after that."""
        return str(self._utf8.decode(b"", True))


Detokenizer = IncrementalDetokenizer | ByteLevelDetokenizer


def make_detokenizer(tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                     skip_special_tokens: bool = True) -> Detokenizer:
    """A `ByteLevelDetokenizer` where the tokenizer is byte-level (`byte_level_tables`),
    else an `IncrementalDetokenizer`."""
    tables = byte_level_tables(tokenizer) if isinstance(tokenizer, Tokenizer) else None
    if tables is None:
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return ByteLevelDetokenizer(tables.skipping if skip_special_tokens else tables.full)
