"""HF transformers' beam search on the default model (fp32): the reference the beam search
tests compare against, token ids and `sequences_scores`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from router.requests import EarlyStopping
from tests.default_model import EOS, chat_prompts, hf_model

# HF generate's early_stopping for each of ours.
HF_EARLY_STOPPING: dict[EarlyStopping, bool | str] = {
    EarlyStopping.HEURISTIC: False, EarlyStopping.FINISHED: True,
    EarlyStopping.NEVER: "never"}


@dataclass(frozen=True)
class BeamCase:
    """One comparison: chat prompt `question` (an index into tests.default_model's), beam
    width, hypotheses returned, max new tokens, length penalty, early stopping."""

    question: int
    width: int
    n: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = EarlyStopping.HEURISTIC

    @property
    def prompt(self) -> list[int]:
        return chat_prompts()[self.question]


# Short answers, so that hypotheses end at EOS as well as at max_tokens.
CASES = [
    BeamCase(4, 2, 2, 10),  # "What is 12 times 7?"
    BeamCase(0, 4, 3, 12, length_penalty=0.5),  # "What is the capital of France?"
    BeamCase(6, 3, 2, 8, length_penalty=2.0, early_stopping=EarlyStopping.FINISHED),
]


@cache
def hf_beams(case: BeamCase) -> list[tuple[list[int], float]]:
    """HF's n best (generated token ids, score), best first."""
    import torch

    with torch.no_grad():
        out = hf_model().generate(
            torch.tensor([case.prompt]), num_beams=case.width, num_return_sequences=case.n,
            do_sample=False, max_new_tokens=case.max_tokens,
            length_penalty=case.length_penalty,
            early_stopping=HF_EARLY_STOPPING[case.early_stopping], eos_token_id=EOS,
            pad_token_id=EOS, output_scores=True, return_dict_in_generate=True)
    beams = []
    for i in range(case.n):
        length = int((out.beam_indices[i] >= 0).sum())  # the padding is EOS too
        ids = out.sequences[i, len(case.prompt):len(case.prompt) + length].tolist()
        beams.append((ids, float(out.sequences_scores[i])))
    return beams
