"""Batched sampling on the last pipeline stage.

One step samples every sequence of the batch at once, on tensors. The order, per row:

1. raw logprobs = log_softmax(raw logits): what `logprobs` reports (vLLM's default
   "raw" logprobs), so they describe the model, not the sampling settings;
2. repetition penalty over prompt + output tokens, then presence and frequency
   penalties over output tokens; then the logit biases, and -inf for the ids a row may not
   sample yet (`min_tokens`), and for the ids a row's structured output does not allow
   (`stage_worker.structured`);
3. greedy rows take the argmax of these penalised logits; the others go on:
4. temperature, then top-k, top-p and min-p masks (`apply_top_k_top_p_min_p`);
5. a draw by the exponential race argmax(probs / q), q ~ Exp(1), equivalent to sampling
   from probs. A seeded row draws q from its own generator, seeded from (seed, output
   index) only, so its tokens do not depend on the batch and survive preemption and
   recompute. Unseeded rows share one batched draw from torch's default generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from foundation.sampling_params import SamplingParams
from kernels.argmax import argmax_rows
from stage_worker.host_transfer import to_device
from stage_worker.structured import apply_masks

_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, output_index: int) -> int:
    """Generator seed for the draw of token `output_index` of a sequence seeded `seed`.

    The `output_index`-th output of a SplitMix64 stream started at `seed`. Mixing matters:
    torch's CPU generator keeps only the low 32 bits of its seed, so a plain
    `seed * C + output_index` would make distinct (seed, index) pairs collide.
    """
    z = (seed + 0x9E3779B97F4A7C15 * (output_index + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class PenaltyInputs:
    """Penalty inputs of a batch; rows without penalties have neutral values and no ids."""

    prompt_mask: torch.Tensor  # [S, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [S, V] float32: occurrences in the output so far
    repetition: torch.Tensor  # [S] float32, 1 = off
    presence: torch.Tensor  # [S] float32, 0 = off
    frequency: torch.Tensor  # [S] float32, 0 = off


@dataclass(frozen=True)
class SamplingBatch:
    """Everything the sampler needs for one step, as tensors on the logits' device.

    Built once per step by `build`. The Python flags are decided here, from the params,
    so that sampling never synchronises with the device to find out which paths to take.
    A mask input is None when no row of the batch uses it.
    """

    num_seqs: int
    temperature: torch.Tensor | None  # [S] float32; greedy rows hold 1.0 so division is safe
    greedy: torch.Tensor | None  # [S] bool
    # (both None in an all-greedy batch: nothing draws)
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None  # [S] int64; <= 0 or >= V means off
    top_p: torch.Tensor | None  # [S] float32; 1.0 means off
    min_p: torch.Tensor | None  # [S] float32; 0.0 means off
    penalties: PenaltyInputs | None
    seeded_rows: tuple[tuple[int, int], ...]  # (row, noise_seed) of seeded, non-greedy rows
    any_unseeded_random: bool
    max_num_logprobs: int | None  # largest `logprobs` asked in the batch; None if nobody
    # Sparse additions to the logits: (rows [N] int64, ids [N] int64, values [N] float32),
    # the logit biases and -inf for ids banned until min_tokens; None if no row has any.
    adjust: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Structured output: (rows [N] int64, bitmask [N, ceil(V / 32)] int32) of the rows whose
    # constraint allows only some ids (bit set = allowed); None if no row has one.
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        output_indices: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Args, one entry per sequence, in batch order:
        params: validated sampling parameters.
        prompt_token_ids / output_token_ids: ids in [0, vocab_size), read only for rows
            with penalties.
        output_indices: tokens generated so far = index of the token being sampled.
        Raises ValueError if the sequences differ in length.
        """
        n = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == len(output_indices) == n:
            raise ValueError(
                f"expected {n} prompts, outputs and output indices, got {len(prompt_token_ids)},"
                f" {len(output_token_ids)} and {len(output_indices)}"
            )
        greedy = [p.is_greedy for p in params]
        random_rows = [p for p in params if not p.is_greedy]
        requested = [p.logprobs for p in params if p.logprobs is not None]

        def column(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return to_device(values, dtype, torch.device(device))  # built on the host

        # A mask is built only if some sampled (non-greedy) row uses it.
        uses_top_k = any(p.top_k > 0 for p in random_rows)
        uses_top_p = any(p.top_p < 1.0 for p in random_rows)
        uses_min_p = any(p.min_p > 0.0 for p in random_rows)
        draws = bool(random_rows)
        return cls(
            num_seqs=n,
            temperature=column([1.0 if p.is_greedy else p.temperature for p in params])
            if draws else None,
            greedy=column(greedy, torch.bool) if draws else None,
            all_greedy=not draws,
            any_greedy=any(greedy),
            top_k=column([p.top_k for p in params], torch.int64) if uses_top_k else None,
            top_p=column([p.top_p for p in params]) if uses_top_p else None,
            min_p=column([p.min_p for p in params]) if uses_min_p else None,
            penalties=_build_penalties(
                params, prompt_token_ids, output_token_ids, vocab_size, device
            ),
            seeded_rows=tuple(
                (row, noise_seed(p.seed, output_indices[row]))
                for row, p in enumerate(params)
                if p.seed is not None and not p.is_greedy
            ),
            any_unseeded_random=any(p.seed is None for p in random_rows),
            max_num_logprobs=max(requested) if requested else None,
            adjust=_build_adjust(params, output_indices, device),
        )


def _build_adjust(params: Sequence[SamplingParams], output_indices: Sequence[int],
                  device: torch.device | str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            for token, bias in p.logit_bias:
                rows.append(row)
                ids.append(token)
                values.append(bias)
        if p.min_tokens and output_indices[row] < p.min_tokens:
            rows += [row] * len(p.banned_until_min)
            ids += p.banned_until_min
            values += [float("-inf")] * len(p.banned_until_min)
    if not rows:
        return None
    packed = to_device([rows, ids], torch.int64, torch.device(device))
    return packed[0], packed[1], to_device(values, torch.float32, torch.device(device))


def _build_penalties(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> PenaltyInputs | None:
    if not any(p.has_penalties for p in params):
        return None
    # Only rows that use a penalty contribute ids; the prompt matters only to repetition.
    prompts = [
        ids if p.repetition_penalty != 1.0 else ()
        for p, ids in zip(params, prompt_token_ids, strict=True)
    ]
    outputs = [
        ids if p.has_penalties else () for p, ids in zip(params, output_token_ids, strict=True)
    ]
    n = len(params)
    # Ids padded with vocab_size into an extra column that is dropped: [S, V + 1] -> [S, V].
    prompt_ids = _padded(prompts, vocab_size, device)
    prompt_mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, prompt_ids, True)
    output_ids = _padded(outputs, vocab_size, device)
    output_counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=device)
    output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, torch.device(device))

    return PenaltyInputs(
        prompt_mask=prompt_mask[:, :vocab_size],
        output_counts=output_counts[:, :vocab_size],
        repetition=column([p.repetition_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
    )


def _padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """[S, max(1, longest row)] int64, short rows filled with `pad`."""
    width = max(1, max((len(r) for r in rows), default=0))
    return to_device([[*r, *([pad] * (width - len(r)))] for r in rows], torch.int64,
                     torch.device(device))


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInputs) -> torch.Tensor:
    """Penalised copy of `logits` [S, V] float32; neutral rows come back bit-identical."""
    counts = penalties.output_counts  # [S, V]
    seen = penalties.prompt_mask | (counts > 0)  # [S, V]: repetition looks at both
    rep = penalties.repetition[:, None]  # [S, 1]
    # HF/vLLM: shrink towards zero, i.e. divide positive logits and multiply negative ones.
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, repeated, logits)
    # OpenAI: presence is a one-off charge for having appeared, frequency one per occurrence.
    logits = logits - penalties.presence[:, None] * (counts > 0)
    return logits - penalties.frequency[:, None] * counts


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy of `logits` [S, V] (temperature already applied) with -inf outside the allowed set.

    top_k [S] int64 (<= 0 or >= V: off), top_p [S] (1: off), min_p [S] (0: off); None skips
    a mask for the whole batch. Top-p sees the distribution left by top-k, as in vLLM;
    min-p compares to the most likely token, which no earlier mask removes, so its place in
    the order does not matter. Each mask is a per-row logit threshold, so tokens tied at a
    boundary are all kept and the result does not depend on how the sort breaks ties.
    """
    num_seqs, vocab = logits.shape
    threshold = logits.new_full((num_seqs, 1), float("-inf"))  # [S, 1]: keep logits >= it
    if top_k is not None or top_p is not None:
        sorted_logits = logits.sort(dim=-1, descending=True).values  # [S, V]
        if top_k is not None:
            k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)  # [S]
            threshold = sorted_logits.gather(1, (k - 1)[:, None])
        if top_p is not None:
            kept = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
            probs = kept.softmax(dim=-1)  # [S, V], renormalised over the top-k survivors
            # Mass strictly before each position ([S, V], exclusive prefix sum); keep the
            # positions where it is still < top_p: the smallest set reaching top_p.
            cumulative = torch.cumsum(probs, dim=-1)
            before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
            num_kept = (before < top_p[:, None]).sum(dim=-1).clamp_min(1)  # [S] >= 1
            p_threshold = sorted_logits.gather(1, (num_kept - 1)[:, None])  # [S, 1]
            # top_p == 1 must keep everything, whatever the float rounding of the cumsum.
            p_threshold = p_threshold.masked_fill(top_p[:, None] >= 1.0, float("-inf"))
            threshold = torch.maximum(threshold, p_threshold)
    masked = logits.masked_fill(logits < threshold, float("-inf"))
    if min_p is not None:
        # p_i / p_max = exp(l_i - l_max): the softmax normaliser cancels.
        ratio = (masked - masked.amax(dim=-1, keepdim=True)).exp()  # [S, V]
        masked = masked.masked_fill(ratio < min_p[:, None], float("-inf"))
    return masked


@dataclass(frozen=True)
class SamplerOutput:
    """One step's result. Log-probabilities are raw: log_softmax of the unmodified logits."""

    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None  # [S] float32, sampled token; None if no row asked
    ranks: torch.Tensor | None  # [S] int64, 1 = most likely token; None if no row asked
    top_token_ids: torch.Tensor  # [S, K] int64, by descending logprob; K = max asked (0 ok)
    top_logprobs: torch.Tensor  # [S, K] float32


class Sampler:
    """Samples one token per row; stateless apart from torch's default generator."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [S, V], any float dtype, on the batch's device; not modified."""
        if logits.dim() != 2 or logits.shape[0] != batch.num_seqs:
            raise ValueError(f"logits must be [{batch.num_seqs}, V], got {list(logits.shape)}")
        if batch.all_greedy and batch.penalties is None and batch.max_num_logprobs is None \
                and batch.adjust is None and batch.allowed is None:
            # Fast path, nothing else to do: the argmax of the logits as they come (widening
            # to float32 is exact and keeps the order).
            return _output(argmax_rows(logits.contiguous()), None, 0)
        logits = logits.float()  # compute in float32 whatever the model's dtype
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # [S, V]
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        if batch.adjust is not None:
            rows, ids, values = batch.adjust
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if batch.allowed is not None:
            logits = apply_masks(logits, *batch.allowed)
        if batch.all_greedy:
            token_ids = argmax_rows(logits)
        else:
            token_ids = _sample_random(logits, batch)
            if batch.any_greedy:
                assert batch.greedy is not None  # built for every batch that draws
                token_ids = torch.where(batch.greedy, argmax_rows(logits), token_ids)
        return _output(token_ids, raw_logprobs, batch.max_num_logprobs or 0)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[S] int64 draws for every row (greedy rows' draws are discarded by the caller)."""
    assert batch.temperature is not None  # built for every batch that draws
    scaled = logits / batch.temperature[:, None]  # [S, V]
    masked = apply_top_k_top_p_min_p(scaled, batch.top_k, batch.top_p, batch.min_p)
    probs = masked.softmax(dim=-1)  # [S, V]; masked tokens get exactly 0
    q = torch.ones_like(probs)  # [S, V] Exp(1) noise
    if batch.any_unseeded_random:
        q.exponential_()
    for row, seed in batch.seeded_rows:
        generator = torch.Generator(device=probs.device).manual_seed(seed)
        q[row].exponential_(generator=generator)
    # q is never 0 in exact arithmetic; the clamp keeps 0 / 0 = nan out of the argmax.
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    return probs.div_(q).argmax(dim=-1)


def _output(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, k: int) -> SamplerOutput:
    num_seqs = token_ids.shape[0]
    if raw_logprobs is None:
        empty_ids = torch.empty(num_seqs, 0, dtype=torch.int64, device=token_ids.device)
        empty_lps = torch.empty(num_seqs, 0, dtype=torch.float32, device=token_ids.device)
        return SamplerOutput(token_ids, None, None, empty_ids, empty_lps)
    logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [S]
    ranks = (raw_logprobs > logprobs[:, None]).sum(dim=-1) + 1  # [S]
    top_logprobs, top_token_ids = raw_logprobs.topk(k, dim=-1)  # [S, K], sorted descending
    return SamplerOutput(token_ids, logprobs, ranks, top_token_ids, top_logprobs)
