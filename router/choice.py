"""One choice of a request on the router: detokenization, stop rules, length."""

from __future__ import annotations

from tokenizers import Tokenizer

from router.detokenizer import IncrementalDetokenizer
from router.outputs import ChoiceDelta, TokenLogprob
from router.scheduler import FinishReason
from router.stop import StopChecker


class ChoiceState:
    """Turns the tokens sampled for one sequence into text deltas and settles its finish.

    The engine core applies the token-level rules and says why a token ends the choice (a
    stop token or EOS: STOP, whose id counts as generated but adds no text; max_tokens or the
    context: LENGTH). A stop string is found here, on the text: it ends the choice with STOP
    and is cut from the text (unless asked to include it); the front then tells the core.
    """

    def __init__(self, index: int, seq_id: int, tokenizer: Tokenizer,
                 prompt_token_ids: tuple[int, ...], stop: tuple[str, ...],
                 include_stop_str: bool, skip_special_tokens: bool) -> None:
        self.index = index
        self.seq_id = seq_id
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop = StopChecker(stop, include_stop_str)
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_token(self, token_id: int, logprob: TokenLogprob | None,
                 verdict: FinishReason | None) -> ChoiceDelta:
        """Account one sampled token; `verdict`: why the core ended the choice with it (None:
        it did not). Returns the delta (maybe empty text) and sets `finish_reason` when the
        choice ends with this token."""
        logprobs = (logprob,) if logprob is not None else ()
        if verdict is FinishReason.STOP:  # a stop token: no text of its own
            return self._finish(FinishReason.STOP, (token_id,), logprobs, "")
        text, stopped = self.stop.process(self.detok.push(token_id))
        if stopped:
            self.finish_reason = FinishReason.STOP
            return ChoiceDelta(self.index, text, (token_id,), logprobs, FinishReason.STOP)
        if verdict is not None:
            return self._finish(verdict, (token_id,), logprobs, text)
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
