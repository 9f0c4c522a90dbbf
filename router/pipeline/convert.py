"""The scheduler's StepPlan -> the internal StageService protos, and stage answers -> domain
objects. The only router module that builds or reads stage protos (besides the stage client
that sends them).

Each stage gets only what it reads: the first stage its inputs (token ids), the last its
token ids (penalties, seeded draws) and sampling settings; a middle stage only block tables
and counts.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from itertools import chain

from foundation.sampling_params import SamplingParams, seed_int64
from protos.stagemesh.stage.v1 import stage_pb2 as pb
from router.outputs import TokenLogprob
from router.pipeline.outcome import PromptScores, StepOutcome
from router.pipeline.shape import PipelineError, PipelineShape, StageInfo
from router.scheduler import CachedSeq, StepPlan

_DECODE_FLAGS = b"\x03"  # CachedBatch.flags of a run-ahead decode: it samples, run-ahead


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    if p.seed is not None:
        msg.seed = seed_int64(p.seed)  # int64 on the wire; draws read it modulo 2**64
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.min_tokens:
        msg.min_tokens = p.min_tokens
        msg.banned_until_min.extend(p.banned_until_min)
    if p.logit_bias:
        msg.logit_bias_ids.extend(t for t, _ in p.logit_bias)
        msg.logit_bias_values.extend(b for _, b in p.logit_bias)
    if p.structured is not None:
        msg.structured_kind = p.structured.kind.value
        msg.structured_spec = p.structured.spec
    return msg


def plans_to_protos(plans: Sequence[StepPlan], num_stages: int,
                    traces: Mapping[int, str] | None = None,
                    holds: Sequence[bool] = ()) -> list[pb.StepPlans]:
    """One message per stage carrying every plan of `plans` (consecutive steps, oldest
    first), in pipeline order (the same object where two stages read the same fields): token
    ids and sampling settings travel to the first and the last stage. `traces`: step id ->
    the traceparent the stages record that step under. `holds`: per plan, its
    `hold_answer` (read by the last stage only; default none)."""
    traces = traces or {}
    full = pb.StepPlans(plans=[_plan_to_proto(p, True, traces.get(p.step_id, ""))
                               for p in plans])
    for msg, hold in zip(full.plans, holds, strict=False):
        if hold:
            msg.hold_answer = True
    if num_stages <= 2:
        return [full] * num_stages
    lean = pb.StepPlans(plans=[_plan_to_proto(p, False, traces.get(p.step_id, ""))
                               for p in plans])
    return [full, *[lean] * (num_stages - 2), full]


def _plan_to_proto(plan: StepPlan, with_tokens: bool, traceparent: str = "") -> pb.StepPlan:
    msg = pb.StepPlan(step_id=plan.step_id,
                      cached_batch=cached_batch_to_proto(plan.cached_seqs, with_tokens))
    if plan.new_seqs:  # the fields most steps leave empty are set only when they are not
        msg.new_seqs.extend(
            pb.NewSequence(
                seq_id=s.seq_id, token_ids=s.token_ids if with_tokens else (),
                prompt_len=s.prompt_len, block_ids=s.block_ids,
                num_computed=s.num_computed_tokens, num_new=s.num_new_tokens, sample=s.sample,
                sampling=sampling_to_proto(s.sampling)
                if with_tokens and isinstance(s.sampling, SamplingParams) else None,
            )
            for s in plan.new_seqs)
    if freed := plan.freed_seq_ids:
        msg.free_seq_ids.extend(freed)
    if plan.block_copies:
        msg.block_copies.extend(pb.BlockCopy(src=c.src_block_id, dst=c.dst_block_id)
                                for c in plan.block_copies)
    if traceparent:
        msg.traceparent = traceparent
    return msg


def cached_batch_to_proto(cached: Sequence[CachedSeq], with_tokens: bool) -> pb.CachedBatch:
    """The diffs of a step as packed columns (the layout is `CachedBatch`'s, in stage.proto).
    Without `with_tokens` (a middle stage) no appended tokens and no run-ahead steps travel.

    Raises:
        OverflowError: a count, position or block id beyond int32.
    """
    if not cached:
        return pb.CachedBatch()
    # One transposition in C gives the columns; array() packs each without a Python loop.
    seq_ids, blocks, computed, new, tokens, from_step, samples = zip(*cached, strict=True)
    n = len(cached)
    zeros = bytes(4 * n)  # n int32 zeros: no block id or token appended
    if blocks.count(()) == n:  # most steps: no sequence opens a block
        block_counts, block_ids = zeros, b""
    else:
        block_counts = _le(array("i", map(len, blocks)))
        block_ids = _le(array("i", chain.from_iterable(blocks)))
    not_ahead = from_step.count(None)
    if with_tokens and not not_ahead and samples.count(True) == n:  # run-ahead decodes only
        flags, ahead = _DECODE_FLAGS * n, _le(array("q", from_step))
    elif with_tokens and not_ahead != n:
        flags = bytes([sample + (0 if k is None else 2)
                       for sample, k in zip(samples, from_step, strict=True)])
        ahead = _le(array("q", [k for k in from_step if k is not None]))
    else:
        flags, ahead = bytes(samples), b""
    if with_tokens and tokens.count(()) != n:
        token_counts = _le(array("i", map(len, tokens)))
        token_ids = _le(array("q", chain.from_iterable(tokens)))
    else:  # a middle stage, or no sequence appends a token (most steps)
        token_counts, token_ids = zeros, b""
    return pb.CachedBatch(
        seq_ids=_le(array("q", seq_ids)), num_computed=_le(array("i", computed)),
        num_new=_le(array("i", new)), flags=flags, input_from_step=ahead,
        new_block_counts=block_counts, new_block_ids=block_ids,
        append_token_counts=token_counts, append_token_ids=token_ids)


def _le(values: array[int]) -> bytes:
    """`values` as little-endian bytes (the wire's byte order)."""
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes()


def outcome_from_result(result: pb.StepResult) -> StepOutcome:
    """The last stage's sampled tokens (the packed arrays) keyed by sequence, and the logprob
    records of the sequences that asked for them.

    Raises:
        PipelineError: the arrays are not whole int64s, differ in length, repeat a sequence,
            or a logprob record names a token the arrays do not hold.
    """
    step = result.step_id
    seq_ids = _unpack_int64(result.sampled_seq_ids, step, "sampled_seq_ids")
    token_ids = _unpack_int64(result.sampled_token_ids, step, "sampled_token_ids")
    if len(seq_ids) != len(token_ids):
        raise PipelineError(f"step {step}: the last stage sent {len(seq_ids)} sequence ids "
                            f"and {len(token_ids)} tokens")
    tokens = dict(zip(seq_ids, token_ids, strict=True))
    if len(tokens) != len(seq_ids):
        raise PipelineError(f"step {step}: the last stage sampled a sequence twice")
    logprobs: dict[int, TokenLogprob] = {}
    for t in result.tokens:
        if tokens.get(t.seq_id) != t.token_id:
            raise PipelineError(f"step {step}: a logprob record names token {t.token_id} of "
                                f"sequence {t.seq_id}, which was not sampled")
        top = tuple(zip(t.top_token_ids, t.top_logprobs, strict=True))
        logprobs[t.seq_id] = TokenLogprob(t.token_id, t.logprob, top)
    return StepOutcome(step, tokens, logprobs,
                       tuple(_prompt_logprobs(step, p) for p in result.prompt_logprobs))


def _prompt_logprobs(step: int, msg: pb.PromptLogprobs) -> PromptScores:
    """One `PromptLogprobs` record as the prompt positions it scores.

    Raises:
        PipelineError: misaligned arrays or a position before 1.
    """
    n, k = len(msg.token_ids), msg.num_top
    if (len(msg.logprobs) != n or k < 0 or len(msg.top_token_ids) != n * k
            or len(msg.top_logprobs) != n * k or msg.start < 1):
        raise PipelineError(f"step {step}: malformed prompt logprobs of sequence {msg.seq_id}")
    ids, values = msg.top_token_ids, msg.top_logprobs
    entries = tuple(
        TokenLogprob(token, logprob, tuple(zip(ids[i * k:(i + 1) * k],
                                               values[i * k:(i + 1) * k], strict=True)))
        for i, (token, logprob) in enumerate(zip(msg.token_ids, msg.logprobs, strict=True)))
    return PromptScores(msg.seq_id, msg.start, entries)


def _unpack_int64(data: bytes, step: int, field: str) -> array[int]:
    """Packed little-endian int64s (the stage's `pack_int64`)."""
    if len(data) % 8:
        raise PipelineError(f"step {step}: {field} holds {len(data)} bytes, not whole int64s")
    values = array("q")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


# The data-plane transports by the router's names for them (`router.pipeline.transports`).
_TRANSPORT_NAMES = {pb.TRANSPORT_TCP: "tcp", pb.TRANSPORT_CUDA_IPC: "cuda_ipc",
                    pb.TRANSPORT_NCCL: "nccl", pb.TRANSPORT_UNIX: "unix"}
_TRANSPORT_ENUMS = {name: value for value, name in _TRANSPORT_NAMES.items()}


def info_from_describe(msg: pb.DescribeResponse) -> StageInfo:
    """The stage's answer as a StageInfo. Transports by name ("tcp", "unix", "cuda_ipc", "nccl";
    one this router does not know is left out); a stage that reports none (older than the
    field) offers "tcp"."""
    transports = tuple(_TRANSPORT_NAMES[t] for t in msg.transports if t in _TRANSPORT_NAMES)
    return StageInfo(
        stage_index=msg.stage_index, num_stages=msg.num_stages, layer_start=msg.layer_start,
        layer_end=msg.layer_end, device=msg.device, dtype=msg.dtype, tp_size=msg.tp_size,
        num_kv_blocks=msg.num_kv_blocks, block_size=msg.block_size, vocab_size=msg.vocab_size,
        max_num_batched_tokens=msg.max_num_batched_tokens, max_num_seqs=msg.max_num_seqs,
        model_impl=msg.model_impl, kv_blocks_used=msg.kv_blocks_used,
        num_sequences=msg.num_sequences, transports=transports or ("tcp",),
        host_id=msg.host_id, standby=msg.standby, steps=msg.steps,
        step_time_ms=msg.step_time_ms, bubble_fraction=msg.bubble_fraction,
        device_id=msg.device_id)


def assign_request(index: int, shape: PipelineShape) -> pb.AssignRequest:
    """Ask a standby stage to become stage `index` of `shape`: its layer range, and the
    pool and step capacity the pipeline was started with."""
    start, end = shape.layer_ranges[index]
    return pb.AssignRequest(stage_index=index, num_stages=shape.num_stages,
                            layer_start=start, layer_end=end,
                            num_kv_blocks=shape.num_kv_blocks,
                            max_num_batched_tokens=shape.max_num_batched_tokens,
                            max_num_seqs=shape.max_num_seqs)


def _transport_enum(transport: str) -> pb.Transport:
    try:
        return _TRANSPORT_ENUMS[transport]
    except KeyError:
        raise ValueError(f"unknown data-plane transport {transport!r}") from None


def listen_request(epoch: int, token: bytes, host: str, transport: str,
                   feedback: bool = False) -> pb.ConnectRequest:
    """Ask a stage to listen for its upstream neighbour over `transport` ("tcp",
    "cuda_ipc") (or, `feedback`, the first stage for the last stage's sampled ids); `host`
    is the router's name for it."""
    role = pb.LINK_ROLE_LISTEN_FEEDBACK if feedback else pb.LINK_ROLE_LISTEN_UPSTREAM
    return pb.ConnectRequest(role=role, transport=_transport_enum(transport), address=host,
                             link_token=token, epoch=epoch)


def connect_request(epoch: int, token: bytes, address: str, transport: str,
                    feedback: bool = False) -> pb.ConnectRequest:
    """Ask a stage to dial its downstream neighbour's listener over `transport` (or,
    `feedback`, the last stage the first stage's feedback listener) at `address`
    (host:port; "unix:@<name>")."""
    role = pb.LINK_ROLE_CONNECT_FEEDBACK if feedback else pb.LINK_ROLE_CONNECT_DOWNSTREAM
    return pb.ConnectRequest(role=role, transport=_transport_enum(transport), address=address,
                             link_token=token, epoch=epoch)
