"""The leader's fan-out to its TP ranks, over the TP group's host-side (gloo) channel.

One message per event, each a tag byte and what follows it:

    b"P" + a data-plane message (`dataplane.wire.encode_message`) whose step id is the
           plan's and whose tensors are the plan's integer arrays and its resolved run-ahead
           inputs (`plan_codec`)
    b"R"   reset: drop every sequence (the Run stream ended)
    b"S"   shutdown: leave the follow loop

A plan that computes nothing is still a P message, never mistaken for a reset. After a
plan, a non-first stage broadcasts the step's activations on the device group (inside
`StageRank.step`). At TP size 1 nothing is sent.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from stage_worker import plan_codec
from stage_worker.dataplane.wire import decode_message, encode_message
from stage_worker.parallel import TPGroup
from stage_worker.plan import StagePlan

PLAN, RESET, SHUTDOWN = b"P", b"R", b"S"
# Both ends are this stage's own processes; the limit only bounds a corrupt length.
MAX_FANOUT_BYTES = 1 << 31


class FanoutKind(enum.Enum):
    PLAN = "plan"
    RESET = "reset"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class FanoutMessage:
    """What a TP rank received: `plan` is set for PLAN only."""

    kind: FanoutKind
    plan: StagePlan | None = None
    fed: dict[int, int] = field(default_factory=dict)  # the plan's run-ahead inputs


def send_plan(tp: TPGroup, plan: StagePlan, fed: Mapping[int, int]) -> None:
    """Rank 0: hand `plan` and its resolved run-ahead inputs `fed` (seq_id -> token) to
    ranks 1..T-1 (which call `receive`)."""
    if tp.size > 1:
        tp.broadcast_bytes(PLAN + encode_message(plan.step_id, plan_codec.encode(plan, fed),
                                                 MAX_FANOUT_BYTES))


def send_reset(tp: TPGroup) -> None:
    if tp.size > 1:
        tp.broadcast_bytes(RESET)


def send_shutdown(tp: TPGroup) -> None:
    if tp.size > 1:
        tp.broadcast_bytes(SHUTDOWN)


def receive(tp: TPGroup) -> FanoutMessage:
    """Ranks 1..T-1: the leader's next message (blocks until it comes).

    Raises:
        ValueError: an unknown tag, or a plan that does not decode (PlanCodecError).
        ProtocolError: a frame that does not parse.
        Either means the group is out of step: the rank must stop.
    """
    data = tp.broadcast_bytes(None)
    tag, body = data[:1], data[1:]
    if tag == RESET and not body:
        return FanoutMessage(FanoutKind.RESET)
    if tag == SHUTDOWN and not body:
        return FanoutMessage(FanoutKind.SHUTDOWN)
    if tag != PLAN:
        raise ValueError(f"unknown TP fan-out message tag {tag!r}")
    step_id, tensors = decode_message(body, MAX_FANOUT_BYTES)
    plan, fed = plan_codec.decode(tensors)
    if plan.step_id != step_id:
        raise ValueError(f"fan-out frame of step {step_id} carries the plan of step "
                         f"{plan.step_id}")
    return FanoutMessage(FanoutKind.PLAN, plan, fed)
