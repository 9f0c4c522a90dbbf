"""The engine core, the pipeline driver, the front and the InferenceService in one process,
over real stage servicers running the null model (no weights: the last stage answers token
(seq_id + tokens already output) mod vocab). Real gRPC, real data plane, no subprocess: each
test takes well under a second of mesh time.

The default model's directory gives the router its tokenizer and config (the null stages read
only its shape).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from foundation.ports import free_port
from router.client import RouterClient
from router.frontend import CoreStartError
from tests.default_model import default_model_dir
from tests.router.inprocess import in_process_mesh, stage_configs, start_stage

BLOCKS = 512


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


def null_stages(model_dir: Path, num_stages: int, **fields: object) -> list:
    return stage_configs(model_dir, num_stages, model_impl="null",
                         **{"num_blocks": BLOCKS, **fields})


async def wait_idle(client: RouterClient, mesh_sequences: object, timeout: float = 10.0) -> None:
    """Until the router holds no KV block and no stage holds a sequence."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await client.stats()
        held = mesh_sequences()  # type: ignore[operator]
        if not (stats.kv_blocks_used or stats.num_running or stats.num_waiting or any(held)):
            return
        assert asyncio.get_running_loop().time() < deadline, (stats, held)
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_tokens_of_concurrent_requests_and_kv_back_to_idle(model_dir: Path,
                                                           num_stages: int) -> None:
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, num_stages)) as mesh, \
                mesh.client() as client:
            outs = await asyncio.gather(*(
                client.complete(prompt=f"request {i}", max_tokens=8, ignore_eos=True,
                                temperature=0.0, request_id=f"r{i}") for i in range(3)))
            # Each request is one sequence; ids are handed out in submission order from 1.
            got = sorted(tuple(o.token_ids[0]) for o in outs)
            assert got == [tuple(range(s, s + 8)) for s in (1, 2, 3)]
            assert all(o.finish_reasons == ["length"] for o in outs)
            assert all(o.usage is not None and o.usage["completion_tokens"] == 8 for o in outs)
            await wait_idle(client, mesh.stage_sequences)

    asyncio.run(run())


def test_duplicate_request_id_is_already_exists(model_dir: Path) -> None:
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 2)) as mesh, \
                mesh.client() as client:
            first = client.generate(prompt="long", max_tokens=4000, ignore_eos=True,
                                    request_id="dup")
            await first.__anext__()  # admitted and streaming
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete(prompt="again", max_tokens=4, request_id="dup")
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "request_id 'dup' is already running" in (info.value.details() or "")
            assert (await first.__anext__()).token_ids  # the first one goes on
            await first.aclose()  # cancels it
            await wait_idle(client, mesh.stage_sequences)

    asyncio.run(run())


def test_cancel_mid_stream_frees_kv_on_the_router_and_every_stage(model_dir: Path) -> None:
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 3)) as mesh, \
                mesh.client() as client:
            stream = client.generate(prompt="x " * 100, max_tokens=4000, ignore_eos=True)
            for _ in range(3):
                await stream.__anext__()
            assert any(mesh.stage_sequences())
            await stream.aclose()
            await wait_idle(client, mesh.stage_sequences)

    asyncio.run(run())


def test_a_stop_right_after_a_cancel_leaves_no_stage_holding_it(model_dir: Path) -> None:
    """The router stopped at once after a client cancelled, while the steps in flight
    take a model's time (50 ms each here): the core tells the stages of the cancel before
    it closes their streams (each stage's reset finds nothing to drop at the close, nor
    at the Drain after it)."""

    async def run() -> None:
        dropped: list[int] = []
        async with in_process_mesh(null_stages(model_dir, 2)) as mesh:
            for stage in mesh.stages:
                leader = stage.servicer.leader

                def counted(reset: Callable[[], int] = leader.reset) -> int:
                    dropped.append(reset())
                    return dropped[-1]

                def slow(plan: Any, step: Callable[[Any], Any] = leader.run_step) -> Any:
                    time.sleep(0.05)
                    return step(plan)
                leader.reset = counted  # type: ignore[method-assign]
                leader.run_step = slow  # type: ignore[method-assign]
            async with mesh.client() as client:
                stream = client.generate(prompt="x " * 100, max_tokens=4000, ignore_eos=True)
                for _ in range(3):
                    await stream.__anext__()
                await stream.aclose()
        # Leaving the block stopped the router (its drain), then the stages: each stage
        # reset when its Run began, at the Drain, and (unless the handler was cancelled
        # with the stream) when its Run ended.
        assert len(dropped) >= 4 and not any(dropped), dropped

    asyncio.run(run())


def test_middle_stages_hold_no_tokens(model_dir: Path) -> None:
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 3)) as mesh, \
                mesh.client() as client:
            stream = client.generate(prompt="a prompt of some tokens", max_tokens=4000,
                                     ignore_eos=True)
            await stream.__anext__()
            await stream.__anext__()
            held = [s.servicer.leader.rank.held.seqs for s in mesh.stages]
            assert all(len(h) == 1 for h in held)
            first, middle, last = (next(iter(h.values())) for h in held)
            assert first.token_ids and last.token_ids
            assert middle.token_ids == []
            # The first stage writes its run-ahead inputs late (after laying the step out):
            # its history holds the last stage's tokens, a prefix of the last stage's, but
            # for a placeholder at the end while a step waits for its token.
            for _ in range(20):
                await stream.__anext__()
            first_ids, last_ids = list(first.token_ids)[:-1], list(last.token_ids)
            assert len(first_ids) > first.prompt_len + 10
            assert first_ids == last_ids[:len(first_ids)]
            seq_id = next(iter(held[0]))
            assert first_ids[first.prompt_len:] == [
                seq_id + i for i in range(len(first_ids) - first.prompt_len)]
            await stream.aclose()

    asyncio.run(run())


def test_capacity_is_the_minimum_over_stages(model_dir: Path) -> None:
    configs = null_stages(model_dir, 2)
    configs[1] = stage_configs(model_dir, 2, model_impl="null", num_blocks=300)[1]

    async def run() -> None:
        async with in_process_mesh(configs) as mesh, mesh.client() as client:
            stats = await client.stats()
            assert stats.kv_blocks_total == 300
            assert [s.transport for s in stats.stages] == ["unix", ""]  # stages of one host
            info = await client.model_info()
            assert info.context_length == min(300 * 16, 8192)  # the pool caps the context
            assert (info.num_stages, info.block_size) == (2, 16)
            assert list(info.hop_transports) == ["unix"]
            assert info.micro_batches == 2  # the helper's: one per stage

    asyncio.run(run())


def test_cpu_stages_that_share_cores_keep_one_micro_batch(model_dir: Path) -> None:
    """Stages in one process compute on the same cores: the router's default (micro_batches
    0, one per device) keeps one step in flight between them, as for stages on one GPU."""
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 2), micro_batches=0) as mesh, \
                mesh.client() as client:
            assert (await client.model_info()).micro_batches == 1
            out = await client.complete(prompt="hello", max_tokens=4, ignore_eos=True)
            assert len(out.token_ids[0]) == 4
            await wait_idle(client, mesh.stage_sequences)

    asyncio.run(run())


def test_router_flags_beyond_a_stage_fail_with_one_line_naming_it(model_dir: Path) -> None:
    configs = stage_configs(model_dir, 2, model_impl="null", num_blocks=BLOCKS,
                            max_num_batched_tokens=4096)
    configs[1] = stage_configs(model_dir, 2, model_impl="null", num_blocks=BLOCKS,
                               max_num_batched_tokens=512)[1]

    async def run() -> None:
        with pytest.raises(CoreStartError) as info:
            async with in_process_mesh(configs, max_num_batched_tokens=1024):
                pass
        assert info.value.kind == "capacity"
        message = str(info.value)
        assert "--max-num-batched-tokens 1024 exceeds" in message
        assert "stage 1" in message and "(512)" in message

    asyncio.run(run())


def test_more_micro_batches_than_stages_fail_with_one_line_naming_the_flag(
        model_dir: Path) -> None:
    async def run() -> None:
        with pytest.raises(CoreStartError) as info:
            async with in_process_mesh(null_stages(model_dir, 2), micro_batches=3):
                pass
        assert info.value.kind == "capacity"
        assert "--micro-batches 3 exceeds the pipeline's 2 stage(s)" in str(info.value)

    asyncio.run(run())


def test_calls_before_the_pipeline_is_up_are_unavailable(model_dir: Path) -> None:
    """The router serves health at once; the API answers UNAVAILABLE until the stages are up,
    then serves with the limits they imply."""
    from router.config import RouterConfig
    from router.main import RouterApp

    configs = [replace(c, port=free_port()) for c in null_stages(model_dir, 2)]

    async def run() -> None:
        app = RouterApp(RouterConfig(
            model_dir=model_dir, model_name="m", port=free_port(), startup_budget_s=20,
            engine_core="task",
            stage_addresses=tuple(f"127.0.0.1:{c.port}" for c in configs)))
        starting = asyncio.create_task(app.start())
        address = f"127.0.0.1:{app.cfg.port}"
        async with RouterClient(address) as client:
            while True:  # the server comes up before the stages
                try:
                    await client.model_info(timeout=1)
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE and "starting" in (
                            e.details() or ""):
                        break
                await asyncio.sleep(0.05)
            assert not await client.health("readiness")
            stages = [await start_stage(c) for c in configs]
            try:
                await starting
                assert (await client.model_info()).model == "m"
                for _ in range(40):  # the readiness watcher flips it within 0.1 s
                    if await client.health("readiness"):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("readiness never became SERVING")
            finally:
                await app.drain_and_stop()
                for stage in stages:
                    await stage.stop()

    asyncio.run(run())


def test_servicer_errors_and_tokenize(model_dir: Path) -> None:
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 1)) as mesh, \
                mesh.client() as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete(prompt="hi", max_tokens=4, model="another-model")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete(prompt="hi", max_tokens=4, temperature=-1.0)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "temperature" in (info.value.details() or "")
            ids = await client.tokenize("What is the capital of France?")
            assert ids == mesh.app.tokenizer.encode("What is the capital of France?")
            await wait_idle(client, mesh.stage_sequences)

    asyncio.run(run())


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [2, 1], ids=["one-per-stage", "one"])
def test_default_model_two_stages_match_hf_greedy(model_dir: Path, micro_batches: int) -> None:
    """The real model split in two in-process stages gives HF transformers' greedy tokens,
    with a micro-batch per stage (stages on their own devices) and with one between them (as
    stages that share a GPU or a host's cores run: each step's tokens fed back to stage 0 for
    the very next step)."""
    from tests.default_model import MAX_NEW, chat_prompts, hf_greedy

    prompts, want = chat_prompts()[:2], hf_greedy()[:2]
    configs = stage_configs(model_dir, 2, num_blocks=128)

    async def run() -> None:
        async with in_process_mesh(configs, micro_batches=micro_batches) as mesh, \
                mesh.client() as client:
            assert (await client.model_info()).micro_batches == micro_batches
            outs = await asyncio.gather(*(
                client.complete(token_ids=p, max_tokens=MAX_NEW, temperature=0.0)
                for p in prompts))
            assert [o.token_ids[0] for o in outs] == want
            await wait_idle(client, mesh.stage_sequences)

    asyncio.run(run())


@pytest.mark.parametrize("seed", [2**63 - 1, -1, -(2**63)])
def test_choices_of_a_seed_at_the_edge_of_int64_are_served(model_dir: Path, seed: int) -> None:
    # Choice i draws from seed + i, which passes 2**63 - 1: the stages get it modulo 2**64
    # as an int64 (the same draws), never a value the stage proto cannot hold.
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 2)) as mesh, \
                mesh.client() as client:
            out = await client.complete(prompt="seeded", max_tokens=4, n=3, seed=seed,
                                        temperature=1.0, ignore_eos=True, timeout=30)
            assert out.finish_reasons == ["length"] * 3
            assert [len(ids) for ids in out.token_ids] == [4] * 3
            await wait_idle(client, mesh.stage_sequences)

    asyncio.run(run())
