"""Beam search through a real 2-stage mesh on the default model (fp32 on CPU): over gRPC
(RouterClient, Complete) and through the gateway with the official `openai` client, the
returned beams are HF transformers' (same token ids in the same order, scores within 1e-4);
bad input is INVALID_ARGUMENT / 400 naming the field and the limit; KV usage returns to idle
on every stage, also after a cancelled search."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import openai
import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from router.client import RouterClient, build_request
from stagemesh.local_mesh import Mesh
from tests.default_model import EOS, chat_prompts
from tests.gateway.conftest import MODEL
from tests.mesh.harness import wait_idle
from tests.router.beam_hf import CASES, HF_EARLY_STOPPING, BeamCase, hf_beams

pytestmark = pytest.mark.slow

# The runtime's fp32 log probabilities against HF's: a beam's score sums ~10 of them.
SCORE_TOL = 1e-4


def _beam_args(case: BeamCase) -> dict[str, Any]:
    return {"beam_width": case.width, "length_penalty": case.length_penalty,
            "early_stopping": HF_EARLY_STOPPING[case.early_stopping]}


async def _grpc_beams(address: str, case: BeamCase) -> list[tuple[list[int], float, str]]:
    """(token ids, beam score, finish reason) of each choice, by index."""
    out: dict[int, tuple[list[int], float, str]] = {}
    async with RouterClient(address) as client:
        async for chunk in client.generate(token_ids=case.prompt, max_tokens=case.max_tokens,
                                           n=case.n, beam_search=_beam_args(case)):
            if chunk.usage is None:
                assert chunk.index not in out  # one whole update per choice
                assert chunk.beam_score is not None and chunk.finish_reason is not None
                out[chunk.index] = (list(chunk.token_ids), chunk.beam_score,
                                    chunk.finish_reason)
    return [out[i] for i in sorted(out)]


def _assert_hf(case: BeamCase, ids: list[list[int]], scores: list[float]) -> None:
    want = hf_beams(case)
    assert ids == [w for w, _ in want]
    assert scores == pytest.approx([s for _, s in want], abs=SCORE_TOL)
    assert scores == sorted(scores, reverse=True)


# Over gRPC the case with early stopping; the other two run through the gateway below (and
# all three against HF in process: tests/router/test_beam_search.py).
@pytest.mark.parametrize("case", CASES[2:], ids=str)
def test_grpc_beams_are_hf_beams(mesh: Mesh, case: BeamCase) -> None:
    got = asyncio.run(_grpc_beams(mesh.address, case))
    _assert_hf(case, [ids for ids, _, _ in got], [score for _, score, _ in got])
    for ids, _, finish in got:
        assert finish == ("stop" if ids[-1] == EOS else "length")
    wait_idle(mesh.stub())


def test_complete_returns_the_beams_with_their_scores(
        stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    case = CASES[1]
    reply = stub.Complete(pb.CompleteRequest(request=build_request(
        token_ids=case.prompt, max_tokens=case.max_tokens, n=case.n,
        beam_search=_beam_args(case))), timeout=120)
    _assert_hf(case, [list(c.token_ids) for c in reply.choices],
               [c.beam_score for c in reply.choices])
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in reply.choices)
    assert reply.usage.prompt_tokens == len(case.prompt)


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def _beam_body(case: BeamCase) -> dict[str, Any]:
    return {"use_beam_search": True, "best_of": case.width,
            "length_penalty": case.length_penalty,
            "early_stopping": HF_EARLY_STOPPING[case.early_stopping], "return_token_ids": True}


def test_openai_completions_return_hf_beams_streamed_or_not(client: openai.OpenAI) -> None:
    case = CASES[0]
    whole = client.completions.create(model=MODEL, prompt=case.prompt, n=case.n,
                                      max_tokens=case.max_tokens, extra_body=_beam_body(case))
    ids = [c.token_ids for c in whole.choices]  # type: ignore[attr-defined]
    want = [w for w, _ in hf_beams(case)]
    assert ids == want
    assert whole.usage is not None and whole.usage.completion_tokens == sum(map(len, want))
    streamed: dict[int, list[int]] = {}
    for chunk in client.completions.create(model=MODEL, prompt=case.prompt, n=case.n,
                                           max_tokens=case.max_tokens, stream=True,
                                           extra_body=_beam_body(case)):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.token_ids)  # type: ignore[attr-defined]
    assert [streamed[i] for i in sorted(streamed)] == want


def test_openai_chat_returns_hf_beams(client: openai.OpenAI) -> None:
    case = CASES[1]  # question 0 through the chat template, as the gateway renders it
    assert case.question == 0
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=case.max_tokens, n=case.n, extra_body=_beam_body(case))
    want = hf_beams(case)
    assert [c.token_ids for c in reply.choices] == [ids for ids, _ in want]  # type: ignore[attr-defined]
    for c, (ids, _) in zip(reply.choices, want, strict=True):
        assert c.finish_reason == ("stop" if ids[-1] == EOS else "length")
        assert c.message.content


def test_grpc_errors_name_the_field_and_the_limit(
        stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    top = min(info.max_n, info.max_logprobs // 2)
    cases = [
        ({"beam_search": {"beam_width": top + 1}}, "beam_search.beam_width", str(top)),
        ({"n": 3, "beam_search": {"beam_width": 2}}, "beam_search.beam_width", "n (3)"),
        ({"beam_search": {}, "temperature": 0.5}, "temperature", "0.5"),
        ({"beam_search": {}, "stop": ["."]}, "stop", "beam search"),
        ({"beam_search": {}, "logprobs": 2}, "logprobs", "beam search"),
        ({"beam_search": {}, "prompt_logprobs": 1}, "prompt_logprobs", "beam search"),
        ({"beam_search": {}, "min_tokens": 2}, "min_tokens", "beam search"),
        ({"beam_search": {}, "structured_output": ("regex", "a+")}, "structured_output",
         "beam search"),
    ]
    for kwargs, field, limit in cases:
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(pb.CompleteRequest(request=build_request(
                "Hi", max_tokens=4, **kwargs)), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert err.value.details().startswith(field) and limit in err.value.details(), \
            err.value.details()


def test_openai_errors_are_400_naming_the_field(client: openai.OpenAI) -> None:
    cases = [
        ({"use_beam_search": True, "best_of": 99}, "best_of"),
        ({"use_beam_search": True, "temperature": 1.0}, "temperature"),
        ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": 2.0}, "length_penalty"),
        ({"best_of": 3}, "best_of"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                                      extra_body=body)
        assert bad.value.body["param"] == param, (body, bad.value.body)  # type: ignore[index]
        assert param in bad.value.body["message"]  # type: ignore[index]


def test_a_cancelled_search_frees_every_block(mesh: Mesh) -> None:
    async def cancel_midway() -> None:
        async with RouterClient(mesh.address) as client:
            stream = client.generate(token_ids=chat_prompts()[1], max_tokens=200,
                                     beam_search={"beam_width": 4}, ignore_eos=True)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(stream.__anext__(), 1.5)

    asyncio.run(cancel_midway())
    stats = wait_idle(mesh.stub())
    assert all(s.kv_blocks_used == 0 and s.num_sequences == 0 for s in stats.stages)
