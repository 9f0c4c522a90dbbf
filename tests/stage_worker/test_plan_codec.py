"""The TP fan-out's plan codec: every plan comes back equal, through the data plane's framing,
and fan-out messages keep their tags (an empty plan is never a reset)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from foundation.sampling_params import SamplingParams
from stage_worker import plan_codec, tp_fanout
from stage_worker.dataplane.wire import decode_message, encode_message
from stage_worker.plan import StageCachedSeq, StageNewSeq, StagePlan
from stage_worker.plan_codec import PlanCodecError
from stage_worker.tp_fanout import FanoutKind

EMPTY = StagePlan(0, (), (), ())

FULL = StagePlan(
    step_id=2**40 + 3,
    new_seqs=(
        StageNewSeq(7, (1, 2, 3, 4, 5), 3, (9, 0, 4), 0, 5, True,
                    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                   seed=-(2**63), repetition_penalty=1.1,
                                   presence_penalty=-0.3, frequency_penalty=1e-9,
                                   logprobs=5, prompt_logprobs=3)),
        StageNewSeq(2**62, (), 0, (11,), 16, 1, False, None),  # a middle stage's view
        StageNewSeq(8, (42,), 1, (), 0, 1, True, SamplingParams(seed=2**64 - 1, logprobs=0)),
        StageNewSeq(9, (3, 3), 2, (1, 2), 1, 1, True, SamplingParams(seed=2**63)),
        StageNewSeq(10, (5,), 1, (6,), 0, 1, True, SamplingParams(temperature=0.0, seed=0)),
    ),
    cached_seqs=(
        StageCachedSeq(3, (), 17, 1, (), True),
        StageCachedSeq(4, (12, 13), 30, 8, (99,), False),
        StageCachedSeq(5, (14,), 0, 2, (1, 2, 3), True),
        StageCachedSeq(6, (15,), 40, 1, (), True, 2**40),  # run-ahead: input from a step
        StageCachedSeq(2**61, (), 3, 1, (), False, 0),
    ),
    free_seq_ids=(1, 2**50, 0),
    block_copies=((3, 4), (0, 65535)),
)

FED = {6: 151, 2**61: 0}  # the run-ahead inputs the leader resolved for FULL
ONLY_FREES = StagePlan(5, (), (), (8, 9))
ONLY_COPIES = StagePlan(6, (), (), (), ((1, 2),))


@pytest.mark.parametrize(("plan", "fed"), [(EMPTY, {}), (FULL, FED), (ONLY_FREES, {}),
                                           (ONLY_COPIES, {})],
                         ids=["empty", "full", "frees", "copies"])
def test_round_trip_through_the_wire_framing(plan: StagePlan, fed: dict[int, int]) -> None:
    tensors = plan_codec.encode(plan, fed)
    assert len(tensors) == plan_codec.NUM_TENSORS
    assert all(t.dtype == torch.int64 for t in tensors)
    assert plan_codec.decode(tensors) == (plan, fed)
    step_id, received = decode_message(encode_message(plan.step_id, tensors, 1 << 30), 1 << 30)
    assert step_id == plan.step_id
    assert plan_codec.decode(received) == (plan, fed)


def test_sampling_params_survive_bit_exact() -> None:
    got, _ = plan_codec.decode(plan_codec.encode(FULL))
    for sent, back in zip(FULL.new_seqs, got.new_seqs, strict=True):
        assert back.sampling == sent.sampling  # floats compared exactly, seeds as integers
        if sent.sampling is not None:
            assert back.sampling is not None and back.sampling.seed == sent.sampling.seed


def test_decode_refuses_what_is_not_a_plan() -> None:
    tensors = plan_codec.encode(FULL)
    with pytest.raises(PlanCodecError, match="10 int64 tensors"):
        plan_codec.decode(tensors[:-1])
    bad_version = [torch.tensor([99, 1]), *tensors[1:]]
    with pytest.raises(PlanCodecError, match="this end speaks 3"):
        plan_codec.decode(bad_version)
    short_tokens = [*tensors[:2], tensors[2][:-1], *tensors[3:]]
    with pytest.raises(PlanCodecError, match="ids for runs"):
        plan_codec.decode(short_tokens)


class _Channel:
    """Stands in for a two-rank TPGroup: what rank 0 broadcasts, rank 1 receives."""

    size = 2

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        if data is not None:
            self.sent.append(data)
            return data
        return self.sent.pop(0)


def test_fanout_keeps_tags_and_an_empty_plan_is_a_plan() -> None:
    channel: Any = _Channel()
    tp_fanout.send_plan(channel, EMPTY, {})
    tp_fanout.send_reset(channel)
    tp_fanout.send_plan(channel, FULL, FED)
    tp_fanout.send_shutdown(channel)
    assert [m[:1] for m in channel.sent] == [b"P", b"R", b"P", b"S"]
    got = [tp_fanout.receive(channel) for _ in range(4)]
    assert [m.kind for m in got] == [FanoutKind.PLAN, FanoutKind.RESET, FanoutKind.PLAN,
                                     FanoutKind.SHUTDOWN]
    assert got[0].plan == EMPTY and got[2].plan == FULL
    assert got[0].fed == {} and got[2].fed == FED
    channel.sent.append(b"X")
    with pytest.raises(ValueError, match="unknown TP fan-out message tag"):
        tp_fanout.receive(channel)


def test_tp_ranks_load_no_protos() -> None:
    code = ("import sys, stage_worker.tp_rank\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('protos', 'grpc')]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
