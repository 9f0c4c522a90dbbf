"""A stream whose consumer lags: updates that fall due while the last one is still queued
are built when the consumer wakes, from every token held since (one decode, one delta), and
nothing but their grouping changes. The front runs on the default model's tokenizer with
core messages made here; a fake endpoint records what the front tells the core."""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

import pytest

from foundation.sampling_params import SamplingParams
from foundation.tokenizer import ModelTokenizer
from router.core.messages import (
    FINISH_LENGTH,
    FINISH_NONE,
    Failed,
    LogprobEntry,
    StepOutputs,
)
from router.frontend import Frontend
from router.outputs import ChoiceDelta, RequestDone, RequestFailed, StreamItem
from router.requests import GenerateRequest
from tests.default_model import default_model_dir

TEXT = "The sea at night: waves, salt, the moon's long road; héllo wörld 🌊 again."


class _Endpoint:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def _request(tokenizer: ModelTokenizer, stop: tuple[str, ...] = ()) -> GenerateRequest:
    return GenerateRequest("r", tuple(tokenizer.encode("Tell me about the sea.")),
                           SamplingParams(temperature=0.0), 100, stop, (), True, 1, 0)


def _step(seq_id: int, token: int, finish: int = FINISH_NONE) -> StepOutputs:
    return StepOutputs(array("q", [seq_id]).tobytes(), array("q", [token]).tobytes(),
                       array("b", [finish]).tobytes())


async def _run(tokenizer: ModelTokenizer, interval: int, lag_after: int,
               stop: tuple[str, ...] = (), fail: bool = False
               ) -> tuple[list[list[StreamItem]], int]:
    """Feed TEXT's tokens one step each; the consumer takes the first `lag_after` updates as
    they are queued, then none until every token is in (the last one ends the choice: LENGTH, or a
    failure with `fail`). Returns what each wake-up of the consumer yielded, and the most
    items the request's outbox held while the consumer lagged (before the last token)."""
    front = Frontend(0, _Endpoint(), tokenizer, stream_interval=interval)  # type: ignore[arg-type]
    stream = front.submit(_request(tokenizer, stop))
    seq_id = next(iter(front.seq_owner))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    updates: list[list[StreamItem]] = []
    queued = 0
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        if last and fail:
            front.handle(Failed([seq_id], "stage 1 is down"))
        else:
            front.handle(_step(seq_id, token, FINISH_LENGTH if last else FINISH_NONE))
        state = front.requests.get("r")
        if len(updates) < lag_after and state is not None and state.wake.is_set():
            updates.append(await anext(stream))
        elif state is not None:
            queued = max(queued, len(state.outbox))
    updates += [items async for items in stream]
    return updates, queued


def _deltas(updates: list[list[StreamItem]]) -> list[ChoiceDelta]:
    return [d for items in updates for d in items if isinstance(d, ChoiceDelta)]


@pytest.mark.parametrize("interval", [1, 3])
def test_a_lagging_consumer_gets_one_update_with_every_token_since(
        tokenizer: ModelTokenizer, interval: int) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = tokenizer.encode("Tell me about the sea.")
    keeping_up, _ = asyncio.run(_run(tokenizer, interval, lag_after=len(ids)))
    lagging, queued = asyncio.run(_run(tokenizer, interval, lag_after=2))
    assert queued == 1  # the update not taken; nothing built behind it
    for updates in (keeping_up, lagging):
        deltas = _deltas(updates)
        assert [t for d in deltas for t in d.token_ids] == ids
        assert "".join(d.text for d in deltas) == tokenizer.decode(prompt + ids)[
            len(tokenizer.decode(prompt)):]
        assert deltas[-1].finish_reason is not None and deltas[-1].finish_reason.value == "length"
        assert isinstance(updates[-1][-1], RequestDone)
    # Keeping up: an update every `interval` tokens. Lagging: after the two taken, the rest
    # came as one delta built at the wake-up (the finish included), then the usage.
    assert all(len(d.token_ids) <= interval for d in _deltas(keeping_up)[:-1])
    assert len(_deltas(lagging)) == 3
    assert len(lagging) == 3 and len(lagging[-1]) == 2


def test_held_tokens_still_go_out_before_a_failure(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    updates, _ = asyncio.run(_run(tokenizer, 1, lag_after=2, fail=True))
    assert [t for d in _deltas(updates) for t in d.token_ids] == ids[:-1]
    assert isinstance(updates[-1][-1], RequestFailed)


def test_a_choice_with_stop_strings_still_ends_at_the_string(tokenizer: ModelTokenizer) -> None:
    """Stop strings need each token's text as it comes: such a choice holds nothing, and a
    lagging consumer gets the text cut at the stop string."""
    updates, _ = asyncio.run(_run(tokenizer, 1, lag_after=2, stop=("salt",)))
    deltas = _deltas(updates)
    assert "".join(d.text for d in deltas).endswith("waves, ")
    assert deltas[-1].finish_reason is not None and deltas[-1].stop_reason == "salt"


def test_a_message_with_several_steps_of_a_sequence_keeps_each_tokens_logprob(
        tokenizer: ModelTokenizer) -> None:
    """The core sends the steps of one message of answers together: a sequence appears
    once per step, and each token keeps its own log probability record."""
    request = GenerateRequest("r", tuple(tokenizer.encode("Tell me about the sea.")),
                              SamplingParams(temperature=0.0, logprobs=1), 3, (), (), True, 1, 0)
    ids = tokenizer.encode(" waves and salt", add_special_tokens=False)[:3]

    async def run() -> list[list[StreamItem]]:
        front = Frontend(0, _Endpoint(), tokenizer, stream_interval=1)  # type: ignore[arg-type]
        stream = front.submit(request)
        seq_id = next(iter(front.seq_owner))
        records = [LogprobEntry(seq_id, token, -0.5 * (i + 1), [(token, -0.5 * (i + 1))])
                   for i, token in enumerate(ids)]
        front.handle(StepOutputs(
            array("q", [seq_id] * 3).tobytes(), array("q", ids).tobytes(),
            array("b", [FINISH_NONE, FINISH_NONE, FINISH_LENGTH]).tobytes(), records))
        return [items async for items in stream]

    deltas = _deltas(asyncio.run(run()))
    assert [t for d in deltas for t in d.token_ids] == ids
    assert [(lp.token_id, lp.logprob) for d in deltas for lp in d.logprobs] == [
        (token, -0.5 * (i + 1)) for i, token in enumerate(ids)]
