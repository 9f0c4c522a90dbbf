"""Seeded sampling: reproducible across batches and recompute; draws follow the
distribution."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from foundation.sampling_params import SamplingParams
from stage_worker.sampling import (
    Sampler,
    noise_seed,
)
from tests.stage_worker.sampling_refs import (
    build,
    random_logits,
    reference_allowed,
    reference_penalties,
    reference_softmax,
)

# ---------------------------------------------------------------- seeded sampling


def sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]
) -> list[int]:
    batch = build(params, logits.shape[1], output_indices=indices)
    return Sampler()(logits, batch).token_ids.tolist()


@pytest.mark.parametrize("output_index", [0, 17])
def test_seeded_rows_ignore_batch_composition_and_global_rng(output_index: int) -> None:
    vocab = 1000  # flat logits over many tokens: a coincidental match has odds ~1e-3
    seeded = random_logits(5, (6, vocab), scale=0.5)
    seeded_params = [SamplingParams(seed=s, top_p=0.95) for s in (1, 2, 3, 4, 5, 2**40)]
    torch.manual_seed(0)
    alone = sample_rows(seeded, seeded_params, [output_index] * 6)
    # Same sequences, reversed and interleaved with greedy, unseeded and other seeded rows.
    others = random_logits(6, (6, vocab))
    other_params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=99)] * 2
    logits = torch.cat([others, seeded.flip(0)])[[0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]]
    params = [p for pair in zip(other_params, seeded_params[::-1], strict=True) for p in pair]
    torch.manual_seed(12345)
    mixed = sample_rows(logits, params, [3] * 12)
    mixed_seeded = sample_rows(logits, params, [3, output_index] * 6)[1::2]
    assert mixed_seeded[::-1] == alone
    assert len(set(alone)) > 1
    assert mixed[1::2] != mixed_seeded  # the output index is part of the noise seed


def test_seeded_decode_replays_after_recompute() -> None:
    vocab, steps = 500, 8
    logits = random_logits(8, (steps, vocab), scale=0.5)
    params = SamplingParams(seed=42, temperature=0.9)
    first = [sample_rows(logits[i : i + 1], [params], [i])[0] for i in range(steps)]
    # Recompute steps 3.. after a preemption, now batched with an unseeded row at row 0.
    for i in range(3, steps):
        pair = torch.stack([logits[(i + 1) % steps], logits[i]])
        assert sample_rows(pair, [SamplingParams(), params], [0, i])[1] == first[i]


def test_different_seeds_draw_differently() -> None:
    vocab = 1000
    logits = random_logits(9, (1, vocab), scale=0.5).expand(32, vocab)
    by_seed = sample_rows(logits, [SamplingParams(seed=s) for s in range(32)], [0] * 32)
    by_index = sample_rows(logits, [SamplingParams(seed=0)] * 32, list(range(32)))
    # 32 draws from ~1000 near-uniform tokens: a handful of repeats at most.
    assert len(set(by_seed)) >= 28 and len(set(by_index)) >= 28


def test_noise_seeds_differ_in_the_low_32_bits() -> None:
    # torch's CPU generator keeps only the low 32 bits of its seed, so user seeds that differ
    # only above bit 32 must still get different noise.
    users = [*range(100), *(s + 2**32 for s in range(100)), *(s + 2**40 for s in range(100))]
    seeds = {noise_seed(s, i) & 0xFFFFFFFF for s in users for i in range(100)}
    assert len(seeds) == len(users) * 100
    assert all(0 <= noise_seed(s, 5) < 2**63 for s in (-(2**63), -1, 0, 2**64 - 1))
    logits = random_logits(10, (1, 1000), scale=0.5).expand(8, 1000)
    params = [SamplingParams(seed=s + k * 2**32) for s in (1, 2) for k in range(4)]
    assert len(set(sample_rows(logits, params, [0] * 8))) >= 6


# ---------------------------------------------------------------- distribution


def chi_square(counts: Counter[int], expected: dict[int, float], draws: int) -> float:
    return sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in expected.items())


# Fixed seeds make these deterministic. With a correct sampler the statistic follows a
# chi-square law with (allowed tokens - 1) degrees of freedom; the limits are its 0.1 %
# upper quantiles, so a correct sampler fails for about one global seed in a thousand,
# while a wrong one at these draw counts (no temperature, no renormalisation, a mask leak,
# correlated seeds) lands in the hundreds or thousands.
CHI_SQUARE_LIMIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.6, top_k=4),
        SamplingParams(temperature=1.7, top_p=0.8),
        SamplingParams(min_p=0.2, repetition_penalty=1.5),
    ],
)
def test_unseeded_sampling_follows_the_distribution(params: SamplingParams) -> None:
    draws, logits_row = 20_000, torch.tensor([1.0, 0.5, 0.0, -0.5, -1.2, 2.0])
    prompt = [5]  # only penalised under repetition_penalty
    batch = build([params] * draws, 6, [prompt] * draws, [[]] * draws)
    assert batch.penalties is None or batch.penalties.prompt_mask[:, 5].all()
    penalised = reference_penalties(logits_row.tolist(), prompt, [], params)
    scaled = [x / params.temperature for x in penalised]
    allowed = reference_allowed(scaled, params.top_k, params.top_p, params.min_p)
    expected = reference_softmax(scaled, allowed)
    torch.manual_seed(2024)
    counts = Counter(Sampler()(logits_row.expand(draws, 6), batch).token_ids.tolist())
    assert set(counts) <= allowed
    assert chi_square(counts, expected, draws) < CHI_SQUARE_LIMIT[len(expected) - 1]


@pytest.mark.parametrize("vary", ["seed", "output_index"])
def test_seeded_sampling_follows_the_distribution(vary: str) -> None:
    # Many seeds (or one seed's successive positions) must still sample the distribution.
    draws, logits_row = 4000, torch.tensor([1.0, 0.5, 0.0, -0.5, -1.2])
    if vary == "seed":
        params, indices = [SamplingParams(seed=s) for s in range(draws)], [7] * draws
    else:
        params, indices = [SamplingParams(seed=7)] * draws, list(range(draws))
    counts = Counter(sample_rows(logits_row.expand(draws, 5), params, indices))
    expected = reference_softmax(logits_row.tolist(), set(range(5)))
    assert chi_square(counts, expected, draws) < CHI_SQUARE_LIMIT[len(expected) - 1]
