"""top-k / top-p / min-p masks and the penalties against the loop references."""

from __future__ import annotations

import pytest
import torch

from foundation.sampling_params import SamplingParams
from stage_worker.sampling import apply_penalties, apply_top_k_top_p_min_p
from tests.stage_worker.sampling_refs import (
    build,
    random_logits,
    reference_allowed,
    reference_penalties,
)

# ---------------------------------------------------------------- masks


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("masks", ["top_k", "top_p", "min_p", "all"])
def test_masks_match_reference(seed: int, masks: str) -> None:
    num_seqs, vocab = 48, 40
    logits = random_logits(seed, (num_seqs, vocab))
    gen = torch.Generator().manual_seed(100 + seed)
    # Include the "off" values (-1, 0, >= V; 1.0; 0.0) and the extremes among random ones.
    top_k = torch.randint(-1, vocab + 3, (num_seqs,), generator=gen)
    top_p = torch.rand(num_seqs, generator=gen).clamp_min(0.01)
    top_p[::5] = 1.0
    min_p = torch.rand(num_seqs, generator=gen) * 0.3
    min_p[::4] = 0.0
    use = {"top_k": masks in ("top_k", "all"), "top_p": masks in ("top_p", "all")}
    use["min_p"] = masks in ("min_p", "all")
    masked = apply_top_k_top_p_min_p(
        logits,
        top_k if use["top_k"] else None,
        top_p if use["top_p"] else None,
        min_p if use["min_p"] else None,
    )
    for r in range(num_seqs):
        expected = reference_allowed(
            logits[r].tolist(),
            int(top_k[r]) if use["top_k"] else -1,
            float(top_p[r]) if use["top_p"] else 1.0,
            float(min_p[r]) if use["min_p"] else 0.0,
        )
        got = set(torch.nonzero(masked[r] > float("-inf")).flatten().tolist())
        assert got == expected, f"row {r}"
        assert torch.equal(masked[r, sorted(got)], logits[r, sorted(got)])  # survivors unchanged


def test_masks_keep_ties_at_the_boundary() -> None:
    # Integer logits force ties at the top-k and top-p cut-offs.
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    masked = apply_top_k_top_p_min_p(logits, top_k=torch.tensor([2, 1]))
    assert (masked > float("-inf")).tolist() == [
        [True, False, True, False, False, False],
        [True, True, True, True, False, False],
    ]
    masked = apply_top_k_top_p_min_p(logits, top_p=torch.tensor([0.3, 0.3]))
    for r in range(2):
        got = set(torch.nonzero(masked[r] > float("-inf")).flatten().tolist())
        assert got == reference_allowed(logits[r].tolist(), -1, 0.3, 0.0)
    assert (masked[1] > float("-inf")).sum() == 4


def test_top_p_always_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3]])
    masked = apply_top_k_top_p_min_p(logits, top_p=torch.tensor([1e-6]))
    assert torch.nonzero(masked[0] > float("-inf")).flatten().tolist() == [3]


# ---------------------------------------------------------------- penalties


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=-0.8),
        SamplingParams(repetition_penalty=1.2, presence_penalty=-2.0, frequency_penalty=2.0),
    ],
)
def test_penalties_match_reference(params: SamplingParams) -> None:
    vocab, gen = 30, torch.Generator().manual_seed(7)
    # Logits of magnitude < ~8 keep float32 rounding (half an ulp is <= 5e-7) under 1e-6.
    logits = torch.randn(4, vocab, generator=gen) * 2
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (0, 5, 12, 3)]
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (4, 0, 20, 9)]
    # Row 3 has no penalties and must come back untouched.
    all_params = [params, params, params, SamplingParams()]
    batch = build(all_params, vocab, prompts, outputs, [len(o) for o in outputs])
    assert batch.penalties is not None
    got = apply_penalties(logits, batch.penalties)
    for r in range(4):
        expected = reference_penalties(logits[r].tolist(), prompts[r], outputs[r], all_params[r])
        torch.testing.assert_close(got[r], torch.tensor(expected), rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3])


def test_no_penalty_inputs_without_penalties() -> None:
    assert build([SamplingParams(), SamplingParams(temperature=0)], 8).penalties is None
