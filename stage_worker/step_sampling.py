"""One step's sampling on the last stage: held sequences + logits -> sampled tokens.

Sampling ends on the device: the token ids stay there (a one-stage pipeline's run-ahead
inputs are read from them) and are copied to pinned host memory without blocking, with the
log probabilities when some sequence asked for them. `StepSample.resolve()` is the step's
one wait on the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from foundation.sampling_params import SamplingParams
from stage_worker.held_seqs import HeldSeq
from stage_worker.host_transfer import HostCopy, to_device, upload
from stage_worker.plan import PromptLogprobs, SampledToken
from stage_worker.sampling import Sampler, SamplingBatch
from stage_worker.step_input import SeqChunk
from stage_worker.structured import GrammarMasks

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class StepSample:
    """The tokens one step sampled, in batch order of its sampling sequences.

    seq_ids: the sampling sequences.
    token_ids: [S] int64 on the runner's device.
    num_logprobs: per row, how many top log probabilities the sequence asked for (None:
        it asked for none).
    host: the pending host copy: token ids [S], then, when a row asked for logprobs, the
        sampled tokens' logprobs [S], the top ids [S, K] and their logprobs [S, K].
    """

    seq_ids: tuple[int, ...]
    token_ids: torch.Tensor
    num_logprobs: tuple[int | None, ...]
    host: HostCopy

    @classmethod
    def of(cls, seq_ids: Sequence[int], token_ids: torch.Tensor,
           num_logprobs: Sequence[int | None], extra: Sequence[torch.Tensor] = ()) -> StepSample:
        """Start the host copy of `token_ids` (and `extra`) now, without waiting for it."""
        return cls(tuple(seq_ids), token_ids, tuple(num_logprobs),
                   HostCopy([token_ids, *extra]))

    def resolve(self) -> tuple[list[int], tuple[SampledToken, ...]]:
        """(token id per row, a logprob record per row that asked for one), waiting once for
        the host copy."""
        host = self.host.wait()
        ids: list[int] = host[0].tolist()
        if len(host) == 1:
            return ids, ()
        lps, top_ids, top_lps = (t.tolist() for t in host[1:])
        records = tuple(
            SampledToken(self.seq_ids[row], ids[row], lps[row], tuple(top_ids[row][:k]),
                         tuple(top_lps[row][:k]))
            for row, k in enumerate(self.num_logprobs) if k is not None)
        return ids, records


def sample_step(sampler: Sampler, logits: torch.Tensor, seqs: Sequence[HeldSeq],
                vocab_size: int, grammars: GrammarMasks | None = None) -> StepSample:
    """One token per row of `logits` [S, V] (fp32), row i for `seqs[i]`.

    A sequence without sampling settings is greedy. Penalties read each sequence's prompt
    and outputs; seeded draws its output count; structured output its matcher (`grammars`,
    which advances it over the outputs recorded since its last step). Mutates nothing
    else.
    """
    params = [s.sampling or GREEDY for s in seqs]
    wants = [p.logprobs for p in params]
    if not seqs:
        return StepSample.of((), torch.empty(0, dtype=torch.int64, device=logits.device), ())
    # Prompts and outputs are read only for rows with penalties: slicing every prompt of a
    # 256-sequence batch each step cost more than the rest of the sampling batch.
    prompts = [s.prompt_ids if p.has_penalties else () for s, p in zip(seqs, params, strict=True)]
    outputs = [s.output_ids if p.has_penalties else () for s, p in zip(seqs, params, strict=True)]
    batch = SamplingBatch.build(params, prompts, outputs, [s.num_outputs for s in seqs],
                                vocab_size, logits.device)
    if grammars is not None and (masks := grammars.masks(seqs, params)) is not None:
        rows, bitmask = masks
        batch = replace(batch, allowed=(to_device(rows, torch.int64, logits.device),
                                        upload(bitmask, logits.device)))
    out = sampler(logits, batch)
    seq_ids = [s.seq_id for s in seqs]
    if out.logprobs is None:
        return StepSample.of(seq_ids, out.token_ids, wants)
    return StepSample.of(seq_ids, out.token_ids, wants,
                         (out.logprobs, out.top_token_ids, out.top_logprobs))


def score_prompts(scores: torch.Tensor, chunks: Sequence[SeqChunk],
                  seqs: Mapping[int, HeldSeq]) -> tuple[PromptLogprobs, ...]:
    """Prompt log probabilities from `scores` [P, V] (fp32): the logits of every chunk's
    `prompt_rows` leading rows, in chunk order (see `step_input.score_rows`). Row r of a
    chunk scores the prompt token at position num_computed + r + 1 against the model's raw
    softmax there (as `logprobs` does: no sampling settings apply). One record per chunk,
    with the top `prompt_logprobs` alternatives its sequence asked for. Waits once for the
    device (only steps that compute prompt positions for such a sequence call this)."""
    targets: list[int] = []
    spans: list[tuple[int, int, int, int]] = []  # seq_id, first position, rows, top k
    for c in chunks:
        if c.prompt_rows:
            state = seqs[c.seq_id]
            start = c.num_computed + 1
            targets += state.token_ids[start:start + c.prompt_rows]
            k = state.sampling.prompt_logprobs if state.sampling is not None else None
            spans.append((c.seq_id, start, c.prompt_rows, k or 0))
    assert len(targets) == scores.shape[0], "one prompt row per target token"
    k = min(max(span[3] for span in spans), scores.shape[1])
    raw = scores.log_softmax(dim=-1) if scores.shape[1] else scores  # [P, V]
    index = to_device(targets, torch.int64, scores.device)
    chosen = (raw.gather(1, index[:, None]).squeeze(1) if scores.shape[1]
              else torch.zeros(len(targets)))
    top_logprobs, top_ids = raw.topk(k, dim=-1)  # [P, k], most likely first
    lps, tops, top_lps = chosen.tolist(), top_ids.tolist(), top_logprobs.tolist()
    records, row = [], 0
    for seq_id, start, n, want in spans:
        end = row + n
        records.append(PromptLogprobs(
            seq_id, start, tuple(targets[row:end]), tuple(lps[row:end]),
            tuple(tuple(ids[:want]) for ids in tops[row:end]),
            tuple(tuple(values[:want]) for values in top_lps[row:end])))
        row = end
    return tuple(records)
