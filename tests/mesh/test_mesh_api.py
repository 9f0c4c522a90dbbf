"""The router's public API as a client sees it: reflection, health, bad input, limits."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from foundation.grpc_core import EXPERIMENTS_ENV, LEGACY_IO
from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import RouterClient, build_request
from tests.mesh.harness import Mesh, readiness, wait_idle
from tests.processes import child_pids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    with Mesh("--stages", "1", "--num-blocks", "256") as m:
        yield m


def test_reflection_lists_services_and_serves_a_dynamic_call(mesh: Mesh) -> None:
    """As grpcurl does: discover the API by reflection, call it with no generated code."""
    with grpc.insecure_channel(mesh.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"stagemesh.v1.InferenceService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("stagemesh.v1.InferenceService").FindMethodByName(
            "GetModelInfo")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary("/stagemesh.v1.InferenceService/GetModelInfo",
                                   request_serializer=request_cls.SerializeToString,
                                   response_deserializer=response_cls.FromString)
        info = call(request_cls(), timeout=5)
        assert info.context_length == 4096  # capped by the 256-block pool
        assert info.vocab_size == 49152 and info.num_stages == 1


def test_readiness_serving(mesh: Mesh) -> None:
    assert readiness(mesh.address) == 1


def test_every_process_of_the_mesh_starts_grpc_with_its_core_settings(mesh: Mesh) -> None:
    """`stagemesh` sets gRPC core's experiments before grpc starts (`foundation.grpc_core`),
    and the processes it starts inherit them (an operator's own value would win)."""
    want = f"{EXPERIMENTS_ENV}={os.environ.get(EXPERIMENTS_ENV, LEGACY_IO)}".encode()
    pids = {**mesh.pids, **{f"{role} child {pid}": pid for role in mesh.pids
                            for pid in child_pids(mesh.pids[role])}}  # the engine core
    assert len(pids) >= 3  # the router, its engine core, the stage
    for role, pid in pids.items():
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert want in f.read().split(b"\0"), role


def test_tokenize_matches_generate_prompt(mesh: Mesh) -> None:
    stub = mesh.stub()
    reply = stub.Tokenize(pb.TokenizeRequest(text="Hello world"), timeout=5)
    assert list(reply.token_ids) == [19556, 905]
    assert reply.tokens[0] == "Hello"


def _err(mesh: Mesh, **kwargs: object) -> grpc.RpcError:
    stub = mesh.stub()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(build_request(**kwargs), timeout=30))  # type: ignore[arg-type]
    return info.value


LONG = "word " * 5000  # ~5000 tokens, past the 4096-token context


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(prompt=LONG, max_tokens=4), "prompt"),
    (dict(prompt="hi there friend", max_tokens=4096), "max_tokens"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=-3), "max_tokens"),
    (dict(prompt="hi", max_tokens=10**6), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-2), "top_k"),
    (dict(prompt="hi", min_p=1.5), "min_p"),
    (dict(prompt="hi", presence_penalty=3.0), "presence_penalty"),
    (dict(prompt="hi", frequency_penalty=-2.5), "frequency_penalty"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="hi", n=0), "n"),
    (dict(prompt="hi", n=1000), "n"),
    (dict(prompt="hi", logprobs=1000), "logprobs"),
    (dict(prompt=""), "prompt"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "role"),
    (dict(token_ids=[1, 2, 49152]), "49152"),
    (dict(token_ids=[-1]), "-1"),
    (dict(prompt="hi", stop=["a"] * 100), "stop"),
    (dict(prompt="hi", stop=["x" * 5000]), "stop"),
    (dict(), "input"),
])
def test_bad_input_is_invalid_argument(mesh: Mesh, kwargs: dict[str, object],
                                       field: str) -> None:
    err = _err(mesh, **kwargs)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in err.details()


def test_unknown_model_is_not_found(mesh: Mesh) -> None:
    err = _err(mesh, prompt="hi", model="gpt-17")
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "gpt-17" in err.details()


def test_oversized_message_is_resource_exhausted(mesh: Mesh) -> None:
    err = _err(mesh, prompt="x" * (5 << 20))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_input_leaks_nothing_and_the_server_still_answers(mesh: Mesh) -> None:
    wait_idle(mesh.stub())

    async def run() -> str:
        async with RouterClient(mesh.address) as client:
            out = await client.complete(messages=[{"role": "user", "content":
                                                   "What is the capital of France?"}],
                                        temperature=0.0, max_tokens=16)
            return out.texts[0]

    assert asyncio.run(run()) == "The capital of France is Paris."


def test_utf8_never_split_across_chunks(mesh: Mesh) -> None:
    async def run() -> list[str]:
        async with RouterClient(mesh.address) as client:
            return [c.text async for c in client.generate(
                messages=[{"role": "user", "content": "Write three emoji and 你好."}],
                temperature=0.9, seed=3, max_tokens=48)]

    chunks = asyncio.run(run())
    assert all("\ufffd" not in c for c in chunks)


def test_stop_string_is_excluded(mesh: Mesh) -> None:
    async def run() -> tuple[str, str | None]:
        async with RouterClient(mesh.address) as client:
            out = await client.complete(
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0.0, max_tokens=16, stop=["Paris"])
            return out.texts[0], out.finish_reasons[0]

    assert asyncio.run(run()) == ("The capital of France is ", "stop")


def test_n_choices_with_seed_are_reproducible(mesh: Mesh) -> None:
    async def run() -> list[str]:
        async with RouterClient(mesh.address) as client:
            out = await client.complete(prompt="Once upon a time", n=3, seed=7,
                                        temperature=1.0, max_tokens=12)
            return out.texts

    first, second = asyncio.run(run()), asyncio.run(run())
    assert first == second and len(first) == 3 and len(set(first)) > 1


def test_admission_limit_is_resource_exhausted() -> None:
    """Past the queued-request limit, requests are refused at once, admitted ones finish."""
    with Mesh("--stages", "1", "--num-blocks", "256", "--max-num-seqs", "2",
              "--max-num-batched-tokens", "64", "--max-queued-requests", "2") as m:
        async def run() -> list[str]:
            async with RouterClient(m.address) as client:
                async def one(i: int) -> str:
                    try:
                        out = await client.complete(prompt=f"Story {i}:", max_tokens=24,
                                                    ignore_eos=True)
                        return out.finish_reasons[0] or "?"
                    except grpc.aio.AioRpcError as e:
                        assert "limit" in (e.details() or "")
                        return e.code().name
                return list(await asyncio.gather(*(one(i) for i in range(12))))

        results = asyncio.run(run())
        assert "RESOURCE_EXHAUSTED" in results
        assert results.count("length") >= 2  # the queue holds 2; more if steps ran between
        assert set(results) <= {"RESOURCE_EXHAUSTED", "length"}
        wait_idle(m.stub())


def test_usage_reports_prefix_cache_hits(mesh: Mesh) -> None:
    """The same prompt twice: the second prefill starts at every full block of the first."""
    messages = [{"role": "user", "content": "Name a river in Europe, and one in Asia, please."}]

    async def run() -> list[dict[str, int]]:
        async with RouterClient(mesh.address) as client:
            usages = []
            for _ in range(2):
                out = await client.complete(messages=messages, temperature=0.0, max_tokens=4)
                assert out.usage is not None
                usages.append(out.usage)
            return usages

    first, second = asyncio.run(run())
    full_blocks = (second["prompt_tokens"] - 1) // 16 * 16  # the last token is always computed
    assert second["cached_prompt_tokens"] == full_blocks
    assert first["cached_prompt_tokens"] < full_blocks
