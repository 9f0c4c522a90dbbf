"""The scheduler's StepPlan -> the internal StageService proto, and StepResult -> tokens.

One plan message goes to every stage: token ids and sampling settings of new sequences
travel to all of them (only the first and the last stage read them); block tables and
counts are what every stage needs.
"""

from __future__ import annotations

from foundation.sampling_params import SamplingParams
from protos.stagemesh.stage.v1 import stage_pb2 as pb
from router.outputs import TokenLogprob
from router.scheduler import StepPlan


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def plan_to_proto(plan: StepPlan, prompt_lens: dict[int, int]) -> pb.StepPlan:
    """`prompt_lens`: seq_id -> prompt length, for the new sequences of the plan."""
    new = [
        pb.NewSequence(
            seq_id=s.seq_id, token_ids=s.token_ids, prompt_len=prompt_lens[s.seq_id],
            block_ids=s.block_ids, num_computed=s.num_computed_tokens,
            num_new=s.num_new_tokens, sample=s.sample,
            sampling=sampling_to_proto(s.sampling) if isinstance(s.sampling, SamplingParams)
            else None,
        )
        for s in plan.new_seqs
    ]
    cached = [
        pb.CachedSequence(seq_id=s.seq_id, new_block_ids=s.new_block_ids,
                          num_computed=s.num_computed_tokens, num_new=s.num_new_tokens,
                          append_token_ids=s.new_token_ids, sample=s.sample)
        for s in plan.cached_seqs
    ]
    copies = [pb.BlockCopy(src=c.src_block_id, dst=c.dst_block_id) for c in plan.block_copies]
    return pb.StepPlan(step_id=plan.step_id, new_seqs=new, cached_seqs=cached,
                       free_seq_ids=plan.freed_seq_ids, block_copies=copies)


def tokens_from_result(result: pb.StepResult
                       ) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
    """seq_id -> sampled token, and seq_id -> its logprob record (meaningful only for
    sequences whose sampling settings asked for logprobs)."""
    sampled: dict[int, int] = {}
    logprobs: dict[int, TokenLogprob] = {}
    for t in result.tokens:
        sampled[t.seq_id] = t.token_id
        top = tuple(zip(t.top_token_ids, t.top_logprobs, strict=True))
        logprobs[t.seq_id] = TokenLogprob(t.token_id, t.logprob, top)
    return sampled, logprobs
