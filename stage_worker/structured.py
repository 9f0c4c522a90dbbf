"""Structured output on the last stage: one llguidance matcher per constrained sequence,
and each step's token masks.

The matcher lives where the tokens are sampled, so it advances right after each sample with
no round trip to the router (run-ahead keeps going). It is made on the sequence's first
sampling step (also after a preemption or a stage restart, when the sequence comes back with
its earlier outputs) and fed every output token the stage has recorded since, so it follows
the sequence whatever the router resent. A matcher that has stopped (the output is
complete), or errored (a token sampled after the end, which the router discards), allows
only the end of sequence.

Masks are bitmasks, one int32 word per 32 token ids (bit i of word w: token 32 w + i), built
on the host; when several sequences are constrained llguidance fills them in parallel
threads (it releases the GIL).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from foundation.sampling_params import SamplingParams
from foundation.tokenizer import ModelTokenizer
from stage_worker.held_seqs import HeldSeq


class GrammarMasks:
    """Token masks for the constrained rows of a step. Built lazily: the tokenizer's
    llguidance form costs about a second, paid on the first constrained sequence."""

    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._tokenizer: Any = None
        self._executor: Any = None
        self._eos: tuple[int, ...] = ()

    def _llguidance(self) -> tuple[Any, Any]:
        if self._tokenizer is None:
            import llguidance

            tok = ModelTokenizer.from_dir(self.model_dir)
            self._eos = tok.special.eos_ids
            self._tokenizer = llguidance.LLTokenizer(
                tok.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=list(self._eos))
            self._executor = llguidance.LLExecutor()
        return self._tokenizer, self._executor

    def masks(self, seqs: Sequence[HeldSeq], params: Sequence[SamplingParams]
              ) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask [len(rows), words] int32 on the host) for the rows of the step whose
        params carry a constraint, in row order; None when no row does."""
        rows = [i for i, p in enumerate(params) if p.structured is not None]
        if not rows:
            return None
        tokenizer, executor = self._llguidance()
        bitmask = torch.zeros(len(rows), self.words, dtype=torch.int32)
        live: list[tuple[Any, int]] = []
        for k, row in enumerate(rows):
            matcher = self._advance(seqs[row], params[row], tokenizer)
            if matcher.is_stopped():  # complete, or errored: the end of sequence only
                for eos in self._eos:
                    bitmask[k, eos // 32] |= _bit(eos % 32)
            else:
                live.append((matcher, k))
        if len(live) == 1:
            matcher, k = live[0]
            view = bitmask[k]
            matcher.unsafe_compute_mask_ptr(view.data_ptr(), self.words * 4)
        elif live:
            executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self.words * 4,
                                             len(rows))
        return rows, bitmask

    @staticmethod
    def _advance(seq: HeldSeq, params: SamplingParams, tokenizer: Any) -> Any:
        """`seq`'s matcher, made if new and fed the outputs recorded since its last step."""
        import llguidance

        assert params.structured is not None
        if seq.grammar is None:
            seq.grammar = llguidance.LLMatcher(tokenizer, params.structured.grammar())
            seq.grammar_consumed = 0
        fresh = seq.output_ids[seq.grammar_consumed:]
        if fresh:
            seq.grammar.consume_tokens(fresh)  # False puts it in its error state: stopped
            seq.grammar_consumed = len(seq.output_ids)
        return seq.grammar


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Copy of `logits` [S, V] with -inf wherever the bitmask of a row in `rows` [N] (int64,
    logits' device) has a 0 bit; `bitmask` [N, W] int32 on the logits' device, W * 32 >= V.
    Other rows are untouched."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [N, V]
    picked = logits[rows].masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out[rows] = picked
    return out
