"""`coalesce`: a lagging consumer's queued deltas merged per choice, in order, against the
pairwise definition (each delta folded into the previous one of the same unfinished choice)
on random streams."""

from __future__ import annotations

import random
from dataclasses import replace

from router.outputs import (
    ChoiceDelta,
    RequestDone,
    StreamItem,
    TokenLogprob,
    Usage,
    coalesce,
)
from router.scheduler import FinishReason
from router.tool_calls.types import ToolCallDelta


def pairwise(items: list[StreamItem]) -> list[StreamItem]:
    out: list[StreamItem] = []
    for item in items:
        prev = out[-1] if out else None
        if isinstance(item, ChoiceDelta) and isinstance(prev, ChoiceDelta) \
                and prev.index == item.index and prev.finish_reason is None:
            out[-1] = replace(item, text=prev.text + item.text,
                              token_ids=prev.token_ids + item.token_ids,
                              logprobs=prev.logprobs + item.logprobs,
                              tool_calls=prev.tool_calls + item.tool_calls)
        else:
            out.append(item)
    return out


def _delta(rng: random.Random, n: int) -> ChoiceDelta:
    token = rng.randrange(1000)
    return ChoiceDelta(
        index=rng.randrange(2), text=f"t{n}", token_ids=(token,),
        logprobs=(TokenLogprob(token, -0.5 * n),) if rng.random() < 0.5 else (),
        finish_reason=FinishReason.STOP if rng.random() < 0.1 else None,
        stop_reason="." if rng.random() < 0.05 else None,
        tool_calls=(ToolCallDelta(index=0, arguments=f"{n}"),) if rng.random() < 0.2 else ())


def test_random_streams_merge_as_the_pairwise_definition() -> None:
    rng = random.Random(0)
    for _ in range(300):
        items: list[StreamItem] = []
        for n in range(rng.randrange(0, 40)):
            items.append(RequestDone(Usage(1, n)) if rng.random() < 0.05 else _delta(rng, n))
        assert coalesce(items) == pairwise(items)


def test_one_choice_lagging_far_behind_is_one_delta() -> None:
    items: list[StreamItem] = [ChoiceDelta(0, f"{i} ", (i,)) for i in range(500)]
    items.append(ChoiceDelta(0, "end", (500,), finish_reason=FinishReason.LENGTH))
    (merged,) = coalesce(items)
    assert isinstance(merged, ChoiceDelta)
    assert merged.token_ids == tuple(range(501)) and merged.text.endswith("499 end")
    assert merged.finish_reason is FinishReason.LENGTH
