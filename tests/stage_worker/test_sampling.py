"""The batched sampler against plain per-row references written here with loops."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from stage_worker.sampling import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    apply_top_k_top_p_min_p,
    noise_seed,
)
from stagemesh.sampling_params import SamplingParams, SamplingParamsError

# ---------------------------------------------------------------- references (may loop)


def reference_allowed(row: Sequence[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens a row may sample: top-k, then top-p on the renormalised survivors, then min-p.
    Thresholds keep every token tied with the last one kept. Computed in float64."""
    vocab = len(row)
    order = sorted(range(vocab), key=lambda i: -row[i])
    allowed = set(range(vocab))
    if 0 < top_k < vocab:
        kth = row[order[top_k - 1]]
        allowed = {i for i in allowed if row[i] >= kth}
    if top_p < 1.0:
        probs = reference_softmax(row, allowed)
        mass, last = 0.0, order[0]
        for i in order:
            if i not in allowed or mass >= top_p:
                break
            mass += probs[i]
            last = i
        allowed = {i for i in allowed if row[i] >= row[last]}
    if min_p > 0.0:
        probs = reference_softmax(row, allowed)
        top = max(probs.values())
        allowed = {i for i in allowed if probs[i] >= min_p * top}
    return allowed


def reference_softmax(row: Sequence[float], allowed: set[int]) -> dict[int, float]:
    top = max(row[i] for i in allowed)
    weights = {i: math.exp(row[i] - top) for i in allowed}
    total = sum(weights.values())
    return {i: w / total for i, w in weights.items()}


def reference_penalties(
    row: Sequence[float], prompt: Sequence[int], output: Sequence[int], params: SamplingParams
) -> list[float]:
    out = list(row)
    for token in set(prompt) | set(output):
        rep = params.repetition_penalty
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token, count in Counter(output).items():
        out[token] -= params.presence_penalty + params.frequency_penalty * count
    return out


# ---------------------------------------------------------------- helpers


def build(
    params: Sequence[SamplingParams],
    vocab_size: int,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    output_indices: Sequence[int] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[]] * n,
        outputs if outputs is not None else [[]] * n,
        output_indices if output_indices is not None else [0] * n,
        vocab_size,
    )


def random_logits(seed: int, shape: tuple[int, int], scale: float = 3.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


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


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_fast_path_skips_logprobs() -> None:
    logits = random_logits(3, (16, 100)).to(torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 16, 100))
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.ranks is None
    assert out.top_token_ids.shape == (16, 0) and out.top_logprobs.shape == (16, 0)


def test_greedy_takes_argmax_of_penalised_logits() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, -1.0], [5.0, 4.0, 1.0, -1.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0, top_k=1)] * 2
    batch = build(params, 4, outputs=[[0], [2]], output_indices=[1, 1])
    # Row 0: token 0 drops to 3.0 < 4.0; row 1: penalising token 2 changes nothing.
    assert Sampler()(logits, batch).token_ids.tolist() == [1, 0]


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = random_logits(4, (32, 50), scale=0.5)  # flat: random rows rarely hit argmax
    # Unseeded random rows make the batched noise cover the greedy rows too.
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.0) for r in range(32)]
    torch.manual_seed(0)
    tokens = Sampler()(logits, build(params, 50)).token_ids
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))
    assert not torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))


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


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_ids_sorted() -> None:
    vocab = 64
    logits = random_logits(11, (5, vocab))
    params = [
        SamplingParams(logprobs=None, temperature=0.0),
        SamplingParams(logprobs=0, temperature=0.5, top_k=3),
        SamplingParams(logprobs=3, repetition_penalty=2.0, seed=1),
        SamplingParams(logprobs=5, temperature=0.0, frequency_penalty=2.0),
        SamplingParams(logprobs=2, min_p=0.1),
    ]
    outputs = [[1, 2], [3], [4, 4], [int(logits[3].argmax())] * 3, []]  # row 3: -6
    batch = build(params, vocab, [[0]] * 5, outputs, [len(o) for o in outputs])
    out = Sampler()(logits, batch)
    raw = torch.log_softmax(logits.double(), dim=-1)  # float64 reference
    assert out.logprobs is not None and out.ranks is not None
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    for r in range(5):
        token = int(out.token_ids[r])
        assert out.logprobs[r].item() == pytest.approx(raw[r, token].item(), abs=1e-5)
        assert int(out.ranks[r]) == 1 + int((raw[r] > raw[r, token]).sum())
    assert out.top_token_ids.shape == (5, 5)  # K = largest request in the batch
    expected_ids = raw.argsort(dim=-1, descending=True)[:, :5]
    assert torch.equal(out.top_token_ids, expected_ids)
    torch.testing.assert_close(out.top_logprobs.double(), raw.gather(1, expected_ids))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert int(out.token_ids[3]) != int(logits[3].argmax())  # penalised, yet raw logprob


def test_logprobs_zero_gives_sampled_logprob_and_empty_top() -> None:
    logits = random_logits(12, (3, 10))
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=0)] * 3, 10))
    assert out.top_token_ids.shape == (3, 0) and out.top_logprobs.shape == (3, 0)
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).amax(dim=-1))


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"temperature": -0.1}, "temperature", "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, "temperature", "temperature must be a finite number >= 0"),
        ({"top_k": -2}, "top_k", "top_k must be -1 or 0 (off) or in [1, 100], got -2"),
        ({"top_k": 101}, "top_k", "top_k must be -1 or 0 (off) or in [1, 100], got 101"),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"min_p": -0.1}, "min_p", "min_p must be in [0, 1], got -0.1"),
        ({"seed": 2**64}, "seed", f"seed must be in [{-(2**63)}, {2**64 - 1}], got {2**64}"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "must be a finite number > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "must be in [-2.0, 2.0], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty", "must be in [-2.0, 2.0], got -3"),
        ({"logprobs": 21}, "logprobs", "logprobs must be None or in [0, 20], got 21"),
        ({"logprobs": -1}, "logprobs", "logprobs must be None or in [0, 20], got -1"),
    ],
)
def test_validation_names_field_and_limit(kwargs: dict, field: str, message: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs).validate(vocab_size=100, max_logprobs=20)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert message in str(info.value) and str(info.value).startswith(field)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0, "top_k": 100, "top_p": 1e-9, "min_p": 1.0, "logprobs": 20},
        {"top_k": 0, "seed": -(2**63), "presence_penalty": -2.0, "frequency_penalty": 2.0},
    ],
)
def test_validation_accepts_the_edges(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate(vocab_size=100, max_logprobs=20)


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams().is_greedy


def test_mismatched_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="expected 2 prompts"):
        SamplingBatch.build([SamplingParams()] * 2, [[]], [[], []], [0, 0], 10)
    with pytest.raises(ValueError, match=r"logits must be \[2, V\]"):
        Sampler()(torch.zeros(3, 10), build([SamplingParams()] * 2, 10))


def test_sampling_params_import_no_torch() -> None:
    code = "import sys, stagemesh.sampling_params; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
