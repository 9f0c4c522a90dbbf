"""A `StagePlan` as integer arrays, for the TP fan-out (the leader parses the router's proto
once; its TP ranks never see a proto, nor pickle).

`encode(plan, fed)` gives ten int64 tensors, which travel in the data plane's framing
(`dataplane.wire.encode_message`); `decode(tensors)` gives the plan and `fed` back, equal to
the ones encoded. `fed` holds the run-ahead inputs the leader resolved (seq_id -> token; only
rank 0 holds the feedback link). Layout, in order:

    0 header        [2]         CODEC_VERSION, step_id
    1 new_seqs      [N, 19]     per new sequence: seq_id, prompt_len, num_computed, num_new,
                                sample, len(token_ids), len(block_ids), has_sampling, top_k,
                                seed_kind (0 none, 1 seed >= 0, 2 seed < 0), seed mod 2**64
                                as int64, logprobs (-1 none), then the float64 bit patterns
                                of temperature, top_p, min_p, repetition_penalty,
                                presence_penalty, frequency_penalty, then prompt_logprobs
                                (-1 none: every rank computes the same logit rows)
    2 new_tokens    [sum len]   every new sequence's token ids, back to back
    3 new_blocks    [sum len]   every new sequence's block ids, back to back
    4 cached_seqs   [C, 7]      per cached sequence: seq_id, num_computed, num_new, sample,
                                len(new_block_ids), len(append_token_ids), input_from_step
                                (-1 none)
    5 cached_blocks [sum len]   new block ids, back to back
    6 cached_tokens [sum len]   appended token ids, back to back
    7 free_seq_ids  [F]
    8 block_copies  [K, 2]      (src, dst)
    9 fed           [R, 2]      (seq_id, token) of every run-ahead input resolved for the step
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate

import torch

from foundation.sampling_params import SamplingParams, seed_int64
from stage_worker.plan import StageCachedSeq, StageNewSeq, StagePlan

CODEC_VERSION = 3
NUM_TENSORS = 10
NEW_COLUMNS = 19
CACHED_COLUMNS = 7
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")
_MASK64 = (1 << 64) - 1


class PlanCodecError(ValueError):
    """Tensors that are not an encoded plan of this codec version."""


def encode(plan: StagePlan, fed: Mapping[int, int] | None = None) -> list[torch.Tensor]:
    """The plan and its resolved run-ahead inputs as NUM_TENSORS int64 CPU tensors (layout in
    the module docstring)."""
    new, cached = plan.new_seqs, plan.cached_seqs
    return [
        _ints([CODEC_VERSION, plan.step_id]),
        _table([_new_row(s) for s in new], NEW_COLUMNS),
        _ints([t for s in new for t in s.token_ids]),
        _ints([b for s in new for b in s.block_ids]),
        _table([[s.seq_id, s.num_computed, s.num_new, int(s.sample), len(s.new_block_ids),
                 len(s.append_token_ids),
                 -1 if s.input_from_step is None else s.input_from_step] for s in cached],
               CACHED_COLUMNS),
        _ints([b for s in cached for b in s.new_block_ids]),
        _ints([t for s in cached for t in s.append_token_ids]),
        _ints(list(plan.free_seq_ids)),
        _table([list(pair) for pair in plan.block_copies], 2),
        _table([[seq_id, token] for seq_id, token in (fed or {}).items()], 2),
    ]


def decode(tensors: Sequence[torch.Tensor]) -> tuple[StagePlan, dict[int, int]]:
    """The plan and the run-ahead inputs `encode` was given.

    Raises:
        PlanCodecError: wrong tensor count, dtype, version or inconsistent lengths.
    """
    if len(tensors) != NUM_TENSORS or any(t.dtype != torch.int64 for t in tensors):
        raise PlanCodecError(f"an encoded plan is {NUM_TENSORS} int64 tensors, got "
                             f"{[str(t.dtype) for t in tensors]}")
    (header, new, new_tokens, new_blocks, cached, cached_blocks, cached_tokens, free, copies,
     fed) = (t.tolist() for t in tensors)
    if len(header) != 2 or header[0] != CODEC_VERSION:
        raise PlanCodecError(f"plan codec header {header}, this end speaks {CODEC_VERSION}")
    token_runs = _runs(new_tokens, [r[5] for r in new])
    block_runs = _runs(new_blocks, [r[6] for r in new])
    new_seqs = tuple(_new_seq(r, next(token_runs), next(block_runs)) for r in new)
    cblock_runs = _runs(cached_blocks, [r[4] for r in cached])
    ctoken_runs = _runs(cached_tokens, [r[5] for r in cached])
    cached_seqs = tuple(
        StageCachedSeq(r[0], next(cblock_runs), r[1], r[2], next(ctoken_runs), bool(r[3]),
                       None if r[6] < 0 else r[6])
        for r in cached)
    plan = StagePlan(header[1], new_seqs, cached_seqs, tuple(free),
                     tuple((src, dst) for src, dst in copies))
    return plan, {seq_id: token for seq_id, token in fed}


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _table(rows: list[list[int]], columns: int) -> torch.Tensor:
    """[len(rows), columns] int64 (the shape holds even with no rows)."""
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), columns)


def _runs(flat: list[int], lengths: list[int]) -> Iterator[tuple[int, ...]]:
    """Consecutive slices of `flat` of the given lengths, which must cover it exactly."""
    if sum(lengths) != len(flat):
        raise PlanCodecError(f"{len(flat)} ids for runs of {sum(lengths)}")
    ends = list(accumulate(lengths))
    return (tuple(flat[end - n:end]) for n, end in zip(lengths, ends, strict=True))


def _float_bits(x: float) -> int:
    return int(_I64.unpack(_F64.pack(x))[0])


def _bits_float(bits: int) -> float:
    return float(_F64.unpack(_I64.pack(bits))[0])


def _new_row(s: StageNewSeq) -> list[int]:
    head = [s.seq_id, s.prompt_len, s.num_computed, s.num_new, int(s.sample),
            len(s.token_ids), len(s.block_ids)]
    p = s.sampling
    if p is None:
        return head + [0] * (NEW_COLUMNS - len(head))
    seed_kind = 0 if p.seed is None else (1 if p.seed >= 0 else 2)
    seed_bits = 0 if p.seed is None else seed_int64(p.seed)
    floats = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
              p.frequency_penalty)
    return head + [1, p.top_k, seed_kind, seed_bits,
                   -1 if p.logprobs is None else p.logprobs] + [_float_bits(x) for x in floats] \
        + [-1 if p.prompt_logprobs is None else p.prompt_logprobs]


def _new_seq(r: list[int], tokens: tuple[int, ...], blocks: tuple[int, ...]) -> StageNewSeq:
    sampling = None
    if r[7]:
        seed = None if r[9] == 0 else (r[10] & _MASK64 if r[9] == 1 else r[10])
        temperature, top_p, min_p, repetition, presence, frequency = (
            _bits_float(b) for b in r[12:18])
        sampling = SamplingParams(
            temperature=temperature, top_k=r[8], top_p=top_p, min_p=min_p, seed=seed,
            repetition_penalty=repetition, presence_penalty=presence,
            frequency_penalty=frequency, logprobs=None if r[11] < 0 else r[11],
            prompt_logprobs=None if r[18] < 0 else r[18])
    return StageNewSeq(r[0], tokens, r[1], blocks, r[2], r[3], bool(r[4]), sampling)
