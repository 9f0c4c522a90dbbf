"""`router.client.chunk_from_proto`: every field of a streamed update reaches its `Chunk`, and
the Chunk is the one its constructor builds (the conversion fills the frozen dataclass
without its ``__init__``)."""

from __future__ import annotations

import dataclasses

import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import Chunk, chunk_from_proto


def _fields(chunk: Chunk) -> set[str]:
    return set(vars(chunk))


def test_a_token_update_is_the_constructors_chunk() -> None:
    msg = pb.GenerateResponse(request_id="r1", index=2, text=" Paris", token_ids=[7, 8])
    chunk = chunk_from_proto(msg)
    assert chunk == Chunk("r1", 2, " Paris", (7, 8), None)
    assert _fields(chunk) == {f.name for f in dataclasses.fields(Chunk)}


def test_every_field_is_converted() -> None:
    top = [pb.TopLogprob(token_id=5, logprob=-0.5), pb.TopLogprob(token_id=6, logprob=-1.0)]
    msg = pb.GenerateResponse(
        request_id="r2", index=1, text="!", token_ids=[9],
        logprobs=[pb.TokenLogprob(token_id=9, logprob=-0.25, top=top)],
        finish_reason=pb.FINISH_REASON_STOP, prompt_tokens=4, stop_string="END",
        prompt_logprobs=[pb.TokenLogprob(token_id=3, logprob=-2.0)], prompt_token_ids=[1, 3],
        tool_calls=[pb.ToolCallDelta(index=0, id="call_1", name="f", arguments="{}")],
        beam_score=-1.5)
    msg.usage.prompt_tokens, msg.usage.completion_tokens = 4, 1
    chunk = chunk_from_proto(msg)
    assert chunk == Chunk(
        "r2", 1, "!", (9,), "stop", ((9, -0.25, ((5, -0.5), (6, -1.0))),),
        {"prompt_tokens": 4, "completion_tokens": 1, "cached_prompt_tokens": 0}, 4, "END",
        ((3, -2.0, ()),), ((0, "call_1", "f", "{}"),), -1.5, (1, 3))
    assert _fields(chunk) == {f.name for f in dataclasses.fields(Chunk)}


def test_a_stop_token_id_and_an_empty_update() -> None:
    assert chunk_from_proto(pb.GenerateResponse(stop_token_id=2)).stop_reason == 2
    assert chunk_from_proto(pb.GenerateResponse()) == Chunk("", 0, "", (), None)


def test_the_chunk_stays_frozen() -> None:
    chunk = chunk_from_proto(pb.GenerateResponse(text="x"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.text = "y"  # type: ignore[misc]
