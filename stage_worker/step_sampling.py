"""One step's sampling on the last stage: held sequences + logits -> sampled tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from foundation.sampling_params import SamplingParams
from stage_worker.held_seqs import HeldSeq
from stage_worker.plan import SampledToken
from stage_worker.sampling import Sampler, SamplerOutput, SamplingBatch

GREEDY = SamplingParams(temperature=0.0)


def sample_step(sampler: Sampler, logits: torch.Tensor, seqs: Sequence[HeldSeq],
                vocab_size: int) -> list[SampledToken]:
    """One token per row of `logits` [S, V] (fp32), row i for `seqs[i]`.

    A sequence without sampling settings is greedy. Penalties read each sequence's prompt
    and outputs; seeded draws its output count. Mutates nothing.
    """
    if not seqs:
        return []
    params = [s.sampling or GREEDY for s in seqs]
    batch = SamplingBatch.build(params, [s.prompt_ids for s in seqs],
                                [s.output_ids for s in seqs], [s.num_outputs for s in seqs],
                                vocab_size, logits.device)
    return _to_tokens(seqs, params, sampler(logits, batch))


def _to_tokens(seqs: Sequence[HeldSeq], params: Sequence[SamplingParams],
               out: SamplerOutput) -> list[SampledToken]:
    ids = out.token_ids.tolist()
    if out.logprobs is None:
        return [SampledToken(s.seq_id, t) for s, t in zip(seqs, ids, strict=True)]
    lps = out.logprobs.tolist()
    top_ids, top_lps = out.top_token_ids.tolist(), out.top_logprobs.tolist()
    tokens = []
    for row, (s, p, t) in enumerate(zip(seqs, params, ids, strict=True)):
        k = p.logprobs or 0
        tokens.append(SampledToken(s.seq_id, t, lps[row], tuple(top_ids[row][:k]),
                                   tuple(top_lps[row][:k])))
    return tokens
