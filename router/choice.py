"""One choice of a request on the router: detokenization, stop rules, length."""

from __future__ import annotations

from collections.abc import Collection

from tokenizers import Tokenizer

from router.detokenizer import IncrementalDetokenizer
from router.outputs import ChoiceDelta, TokenLogprob
from router.scheduler import FinishReason
from router.stop import StopChecker


class ChoiceState:
    """Turns the tokens sampled for one sequence into text deltas and decides its finish.

    A stop token (EOS unless ignored, or a requested stop id) ends the choice; its id counts
    as generated but adds no text. A stop string ends it and is cut from the text (unless
    asked to include it). `max_tokens` ends it with LENGTH.
    """

    def __init__(self, index: int, seq_id: int, tokenizer: Tokenizer,
                 prompt_token_ids: tuple[int, ...], max_tokens: int,
                 stop_token_ids: Collection[int], stop: tuple[str, ...],
                 include_stop_str: bool, skip_special_tokens: bool) -> None:
        self.index = index
        self.seq_id = seq_id
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop = StopChecker(stop, include_stop_str)
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_token(self, token_id: int, logprob: TokenLogprob | None,
                 length_capped: bool = False) -> ChoiceDelta:
        """Account one sampled token; returns the delta (maybe empty text) and sets
        `finish_reason` when this token ends the choice. `length_capped`: the scheduler
        ended the sequence at the model's context."""
        self.num_tokens += 1
        logprobs = (logprob,) if logprob is not None else ()
        if token_id in self.stop_token_ids:
            return self._finish(FinishReason.STOP, (token_id,), logprobs, "")
        text, stopped = self.stop.process(self.detok.push(token_id))
        if stopped:
            self.finish_reason = FinishReason.STOP
            return ChoiceDelta(self.index, text, (token_id,), logprobs, FinishReason.STOP)
        if self.num_tokens >= self.max_tokens or length_capped:
            return self._finish(FinishReason.LENGTH, (token_id,), logprobs, text)
        return ChoiceDelta(self.index, text, (token_id,), logprobs)

    def abort(self) -> ChoiceDelta:
        return self._finish(FinishReason.ABORT, (), (), "")

    def _finish(self, reason: FinishReason, ids: tuple[int, ...],
                logprobs: tuple[TokenLogprob, ...], text: str) -> ChoiceDelta:
        """Release held text (an undecided stop-string prefix, an unfinished character)."""
        tail, stopped = self.stop.process(self.detok.flush())
        text += tail
        if not stopped:
            text += self.stop.flush()
        self.finish_reason = reason
        return ChoiceDelta(self.index, text, ids, logprobs, reason)
