"""Plain per-row references for the batched sampler (written with loops), and helpers that
build its inputs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

from foundation.sampling_params import SamplingParams
from stage_worker.sampling import (
    SamplingBatch,
)

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
