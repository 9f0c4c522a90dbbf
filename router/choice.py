"""One choice of a request on the router: detokenization, stop rules, length."""

from __future__ import annotations

from dataclasses import replace

from tokenizers import Tokenizer

from router.detokenizer import make_detokenizer
from router.outputs import ChoiceDelta, TokenLogprob
from router.scheduler import FinishReason
from router.stop import StopChecker
from router.tool_calls.parsers import ToolCallParser
from router.tool_calls.types import call_deltas


class ChoiceState:
    """Turns the tokens sampled for one sequence into text deltas and settles its finish.

    The engine core applies the token-level rules and says why a token ends the choice (a
    stop token or EOS: STOP, whose id counts as generated but adds no text; max_tokens or the
    context: LENGTH). A stop string is found here, on the text: it ends the choice with STOP
    and is cut from the text (unless asked to include it); the front then tells the core.

    With no stop strings, nothing about a token but its text needs it at once, so `on_token`
    only holds the ids (returns None) and `take_held` detokenizes them in one decode when the
    stream is due an update (`stream_interval` tokens, or when a lagging stream's handler
    wakes); a finish includes what is held. With stop strings every token is decoded as it
    comes, so the choice ends at the token that completes one.

    `tool_parser`: the choice's text goes through it last (after stop strings): the text of
    tool calls leaves `text` and comes back as `ChoiceDelta.tool_calls` pieces, and a choice
    that ends with STOP having made calls says so (`called_tools`).
    """

    def __init__(self, index: int, seq_id: int, tokenizer: Tokenizer,
                 prompt_token_ids: tuple[int, ...], stop: tuple[str, ...],
                 include_stop_str: bool, skip_special_tokens: bool,
                 stop_token_ids: tuple[int, ...] = (),
                 min_tokens: int = 0, tool_parser: ToolCallParser | None = None) -> None:
        """`stop_token_ids`: the request's own (not EOS), to name one in `stop_reason`;
        `min_tokens`: no stop string is looked for before this many tokens (vLLM's)."""
        self.tool_parser = tool_parser
        self.index = index
        self.stop_token_ids = stop_token_ids
        self.min_tokens = min_tokens
        self.generated = 0
        self.seq_id = seq_id
        self.detok = make_detokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop = StopChecker(stop, include_stop_str)
        self.finish_reason: FinishReason | None = None
        self.holds = not stop
        # Tokens held undecoded while `holds` (see the class); a token that ends nothing and
        # carries no log probability may be appended here directly, as `on_token` would.
        self.held: list[int] = []
        self._held_logprobs: list[TokenLogprob] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_token(self, token_id: int, logprob: TokenLogprob | None,
                 verdict: FinishReason | None) -> ChoiceDelta | None:
        """Account one sampled token; `verdict`: why the core ended the choice with it (None:
        it did not). Returns the delta (maybe empty text), or None when the token is only
        held (see the class); sets `finish_reason` when the choice ends with this token."""
        delta = self._on_token(token_id, logprob, verdict)
        return delta if delta is None else self._tool_calls(delta)

    def _tool_calls(self, delta: ChoiceDelta) -> ChoiceDelta:
        """`delta` with its text through the tool-call parser, if the choice has one."""
        parser = self.tool_parser
        if parser is None:
            return delta
        before = parser.calls
        text, calls = parser.feed(delta.text)
        if delta.finish_reason is not None:
            tail, more = parser.finish()
            text, calls = text + tail, calls + more
        pieces = tuple(piece for i, call in enumerate(calls)
                       for piece in call_deltas(before + i, call))
        called = delta.finish_reason is FinishReason.STOP and parser.calls > 0
        return replace(delta, text=text, tool_calls=pieces, called_tools=called)

    def _on_token(self, token_id: int, logprob: TokenLogprob | None,
                  verdict: FinishReason | None) -> ChoiceDelta | None:
        if verdict is None and self.holds:
            self.held.append(token_id)
            if logprob is not None:
                self._held_logprobs.append(logprob)
            return None
        ids, logprobs = self._take(token_id, logprob)
        self.generated += len(ids)
        if verdict is FinishReason.STOP:  # a stop token: no text of its own
            return self._finish(FinishReason.STOP, ids, logprobs,
                                self.detok.push_many(ids[:-1]) if len(ids) > 1 else "",
                                token_id if token_id in self.stop_token_ids else None)
        if self.generated < self.min_tokens:  # too early for a stop string
            text, stopped = self.detok.push_many(ids), False
        else:
            text, stopped = self.stop.process(self.detok.push_many(ids))
        if stopped:
            self.finish_reason = FinishReason.STOP
            return ChoiceDelta(self.index, text, ids, logprobs, FinishReason.STOP,
                               self.stop.matched)
        if verdict is not None:
            return self._finish(verdict, ids, logprobs, text)
        return ChoiceDelta(self.index, text, ids, logprobs)

    def take_held(self) -> ChoiceDelta | None:
        """The tokens held since the last delta as one delta (None if none are held)."""
        if not self.held:
            return None
        ids, logprobs = self._take(None, None)
        return self._tool_calls(ChoiceDelta(self.index, self.detok.push_many(ids), ids,
                                            logprobs))

    def _take(self, token_id: int | None, logprob: TokenLogprob | None,
              ) -> tuple[tuple[int, ...], tuple[TokenLogprob, ...]]:
        """The held tokens (and logprobs) followed by this one, if any; nothing stays held."""
        ids = (*self.held, token_id) if token_id is not None else tuple(self.held)
        logprobs = tuple(self._held_logprobs)
        if logprob is not None:
            logprobs += (logprob,)
        self.held.clear()
        self._held_logprobs.clear()
        return ids, logprobs

    def abort(self) -> ChoiceDelta:
        self.held.clear()
        self._held_logprobs.clear()
        return self._tool_calls(self._finish(FinishReason.ABORT, (), (), ""))

    def _finish(self, reason: FinishReason, ids: tuple[int, ...],
                logprobs: tuple[TokenLogprob, ...], text: str,
                stop_reason: str | int | None = None) -> ChoiceDelta:
        """Release held text (an undecided stop-string prefix, an unfinished character)."""
        tail, stopped = self.stop.process(self.detok.flush())
        text += tail
        if stopped:  # the held text completed a stop string after all
            reason, stop_reason = FinishReason.STOP, self.stop.matched
        else:
            text += self.stop.flush()
        self.finish_reason = reason
        return ChoiceDelta(self.index, text, ids, logprobs, reason, stop_reason)
