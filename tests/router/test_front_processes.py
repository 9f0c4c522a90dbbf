"""Several front processes serving one engine core (`api_processes`): the router's own front
0 and real front processes (`router.front_process`) bound to the same port with SO_REUSEPORT,
over real stage servicers in the test's process. Each client gets a TCP connection of its
own, which the kernel hands to one front; which one is found out from the core's count of
requests finished by front (`CoreStats.finished_by_front`).

With the null model the first token of a sequence is its id mod vocab, and sequence ids are
`front << 40 | n` (n = 1, 2, ... per front), so the tokens also say which front served them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from foundation.model_config import ModelConfig
from foundation.tls import client_tls, server_tls
from router import fronts as fronts_module
from router.client import Chunk, RouterClient
from router.core.messages import SEQ_ID_FRONT_SHIFT
from tests.default_model import default_model_dir
from tests.router.inprocess import InProcessMesh, in_process_mesh, stage_configs
from tests.router.test_engine_inprocess import null_stages, wait_idle
from tests.tls_certs import write_pki

PROBE_TRIES = 64  # connections to open until one lands on the wanted front (2^-64 to fail)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def vocab(model_dir: Path) -> int:
    return ModelConfig.from_dir(model_dir).vocab_size


async def readiness_gone(client: RouterClient, tries: int = 100) -> bool:
    """Whether the front `client` reaches reports readiness NOT_SERVING within `tries`
    polls 20 ms apart."""
    for _ in range(tries):
        if not await client.health("readiness"):
            return True
        await asyncio.sleep(0.02)
    return False


def seq_of_first_token(token: int, vocab: int) -> tuple[int, int]:
    """(front, n) of the null-model sequence whose first token is `token` (n is small)."""
    return min(((front, (token - (front << SEQ_ID_FRONT_SHIFT)) % vocab) for front in range(4)),
               key=lambda c: c[1])


async def front_of(mesh: InProcessMesh, client: RouterClient) -> int:
    """Which front serves `client`'s connection: run one short request on it and see whose
    count of finished requests went up."""
    before = (await mesh.app.front.stats()).finished_by_front
    await client.complete(prompt="probe", max_tokens=1, ignore_eos=True)
    after = (await mesh.app.front.stats()).finished_by_front
    changed = [f for f in after if after[f] != before.get(f, 0)]
    assert len(changed) == 1, (before, after)
    return changed[0]


async def clients_on(mesh: InProcessMesh, front: int, count: int,
                     make: Callable[[], RouterClient] | None = None) -> list[RouterClient]:
    """`count` clients (from `make`; default: plaintext, no key) whose connections the
    kernel gave to `front`."""
    found: list[RouterClient] = []
    for _ in range(PROBE_TRIES):
        client = make() if make else mesh.client(own_connection=True)
        if await front_of(mesh, client) == front:
            found.append(client)
            if len(found) == count:
                return found
        else:
            await client.close()
    raise AssertionError(f"no connection landed on front {front} in {PROBE_TRIES} tries")


async def close_all(clients: list[RouterClient]) -> None:
    for client in clients:
        await client.close()


def test_concurrent_clients_on_two_fronts_get_exact_streams(model_dir: Path, vocab: int
                                                              ) -> None:
    """24 clients, each on its own connection: both fronts serve some, every stream is whole
    and exact, the core serves both fronts and counts every request once."""
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 2), api_processes=2) as mesh:
            assert list(mesh.app.fronts.pids()) == [1]
            clients = [mesh.client(own_connection=True) for _ in range(24)]
            outs = await asyncio.gather(*(
                c.complete(prompt=f"request {i}", max_tokens=16 + i % 5, ignore_eos=True,
                           temperature=0.0, request_id=f"r{i}") for i, c in enumerate(clients)))
            by_front: dict[int, list[int]] = {0: [], 1: []}
            for i, out in enumerate(outs):
                tokens = out.token_ids[0]
                assert len(tokens) == 16 + i % 5 and out.finish_reasons == ["length"]
                assert tokens == [(tokens[0] + k) % vocab for k in range(len(tokens))]
                assert out.usage is not None and out.usage["completion_tokens"] == len(tokens)
                front, n = seq_of_first_token(tokens[0], vocab)
                by_front[front].append(n)
            # Each front numbers its sequences 1, 2, ...; both served some.
            assert all(sorted(ns) == list(range(1, len(ns) + 1)) for ns in by_front.values())
            assert by_front[0] and by_front[1], by_front
            stats = await mesh.app.front.stats()
            assert stats.fronts == [0, 1]
            assert stats.finished_by_front == {f: len(ns) for f, ns in by_front.items()}
            assert (await clients[0].stats()).requests_finished == 24
            await wait_idle(clients[0], mesh.stage_sequences)
            await close_all(clients)

    asyncio.run(run())


def test_greedy_tokens_with_two_fronts_match_one_front(model_dir: Path) -> None:
    """The default model, greedy: the same requests give the same tokens whether one front
    serves them all or two share them (four clients on each)."""
    configs = stage_configs(model_dir, 1, num_blocks=128)

    async def tokens(api_processes: int) -> dict[str, list[int]]:
        async with in_process_mesh(configs, api_processes=api_processes) as mesh:
            if api_processes == 1:
                clients = [mesh.client(own_connection=True) for _ in range(8)]
            else:
                clients = [*await clients_on(mesh, 0, 4), *await clients_on(mesh, 1, 4)]
            outs = await asyncio.gather(*(
                c.complete(prompt=f"Count to {i}:", max_tokens=8, ignore_eos=True,
                           temperature=0.0, request_id=f"g{i}") for i, c in enumerate(clients)))
            await wait_idle(clients[0], mesh.stage_sequences)
            await close_all(clients)
            assert all(len(o.token_ids[0]) == 8 for o in outs)
            return {f"g{i}": o.token_ids[0] for i, o in enumerate(outs)}

    one = asyncio.run(tokens(1))
    assert asyncio.run(tokens(2)) == one


def test_a_request_id_live_on_one_front_is_refused_on_the_other(model_dir: Path) -> None:
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 2), api_processes=2) as mesh:
            (first,), (second,) = await clients_on(mesh, 0, 1), await clients_on(mesh, 1, 1)
            for a, b in ((first, second), (second, first)):
                stream = a.generate(prompt="long", max_tokens=4000, ignore_eos=True,
                                    request_id="dup")
                await stream.__anext__()  # admitted and streaming
                for client in (b, a):  # the other front, then the same one
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await client.complete(prompt="again", max_tokens=4, request_id="dup")
                    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
                    assert "request_id 'dup' is already running" in (info.value.details() or "")
                assert (await stream.__anext__()).token_ids  # the first one goes on
                await stream.aclose()  # cancels it: the id is free again
                await wait_idle(b, mesh.stage_sequences)
            done = await second.complete(prompt="again", max_tokens=4, ignore_eos=True,
                                         request_id="dup")
            assert done.finish_reasons == ["length"]
            await close_all([first, second])

    asyncio.run(run())


def test_abort_by_request_id_from_another_front(model_dir: Path) -> None:
    """The public Abort, called on one front for a request streaming on the other (and on
    the same one): every choice of the stream ends with finish reason abort, then the usage;
    KV goes back to idle; a second Abort and an unknown id are NOT_FOUND."""
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 2), api_processes=2) as mesh:
            (first,), (second,) = await clients_on(mesh, 0, 1), await clients_on(mesh, 1, 1)
            for owner, caller in ((first, second), (second, second)):
                stream = owner.generate(prompt="long", max_tokens=4000, ignore_eos=True, n=2,
                                        request_id="victim")
                chunks = [await stream.__anext__()]  # admitted and streaming
                await caller.abort("victim")
                chunks += [c async for c in stream]
                finishes = [c.finish_reason for c in chunks if c.finish_reason]
                assert sorted(finishes) == ["abort", "abort"], finishes
                usage = chunks[-1].usage
                assert usage is not None and usage["completion_tokens"] == sum(
                    len(c.token_ids) for c in chunks) < 4000 * 2
                await wait_idle(caller, mesh.stage_sequences)
                with pytest.raises(grpc.aio.AioRpcError) as gone:
                    await caller.abort("victim")
                assert gone.value.code() == grpc.StatusCode.NOT_FOUND
                assert "'victim'" in (gone.value.details() or "")
            done = await first.complete(prompt="after", max_tokens=4, ignore_eos=True,
                                        request_id="victim")  # the id is free again
            assert done.finish_reasons == ["length"]
            await close_all([first, second])

    asyncio.run(run())


async def _until_broken(stream: AsyncIterator[Chunk]) -> grpc.StatusCode:
    try:
        async for _ in stream:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    raise AssertionError("the stream of a killed front ended normally")


def test_a_killed_front_process_frees_its_sequences_and_is_replaced(
        model_dir: Path, vocab: int, caplog: pytest.LogCaptureFixture) -> None:
    """SIGKILL the front process mid-stream: its clients' streams break, the core aborts its
    three sequences (KV freed on the router and the stages), front 0's two streams go on, and
    the router starts a new front process (front 2) that serves."""
    caplog.set_level(logging.INFO, logger="stagemesh.core")

    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 2), api_processes=2) as mesh:
            on0, on1 = await clients_on(mesh, 0, 2), await clients_on(mesh, 1, 3)
            streams = [c.generate(prompt=f"stream {i}", max_tokens=4000, ignore_eos=True)
                       for i, c in enumerate(on0 + on1)]
            firsts = [(await s.__anext__()).token_ids[0] for s in streams]
            assert [seq_of_first_token(t, vocab)[0] for t in firsts] == [0, 0, 1, 1, 1]
            assert (await on0[0].stats()).num_running == 5

            os.kill(mesh.app.fronts.pids()[1], signal.SIGKILL)
            codes = await asyncio.gather(*(_until_broken(s) for s in streams[2:]))
            assert codes == [grpc.StatusCode.UNAVAILABLE] * 3
            for _ in range(200):  # the router notices within a moment; the next plan frees
                stats = await on0[0].stats()
                if stats.num_running == 2 and mesh.stage_sequences() == [2, 2]:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError((stats, mesh.stage_sequences()))
            assert "front 1 is gone: 3 of its sequence(s) aborted" in caplog.text

            for stream, first in zip(streams[:2], firsts[:2], strict=True):  # front 0 goes on
                more = (await stream.__anext__()).token_ids
                assert more[0] > first
                await stream.aclose()
            await wait_idle(on0[0], mesh.stage_sequences)

            for _ in range(3000):  # the replacement starts a Python process: up to 60 s
                if 2 in mesh.app.fronts.serving:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the replacement front 2 did not serve within 60 s")
            (on2,) = await clients_on(mesh, 2, 1)  # the replacement, a new front id
            assert mesh.app.fronts.restarts == 1 and list(mesh.app.fronts.pids()) == [2]
            out = await on2.complete(prompt="after", max_tokens=5, ignore_eos=True)
            assert seq_of_first_token(out.token_ids[0][0], vocab)[0] == 2
            assert (await mesh.app.front.stats()).fronts == [0, 2]
            await close_all([*on0, *on1, on2])

    asyncio.run(run())


def test_past_the_restart_limit_the_router_is_told_to_stop(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A front process that keeps dying is not restarted for ever: past the limit (0 here)
    `failed` is set with the reason (the router then drains and exits 1), and front 0 goes
    on serving meanwhile."""
    monkeypatch.setattr(fronts_module, "RESTART_LIMIT", 0)

    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 1), api_processes=2) as mesh:
            os.kill(mesh.app.fronts.pids()[1], signal.SIGKILL)
            await asyncio.wait_for(mesh.app.fronts.failed.wait(), 10)
            assert mesh.app.fronts.error.startswith(
                "front processes exited 1 time(s) within 600s (the last: front 1, status -9)")
            assert mesh.app.fronts.pids() == {} and mesh.app.fronts.restarts == 0
            async with mesh.client() as client:
                out = await client.complete(prompt="still", max_tokens=3, ignore_eos=True)
                assert out.finish_reasons == ["length"]

    asyncio.run(run())


def test_drain_with_two_fronts(model_dir: Path) -> None:
    """Draining: readiness NOT_SERVING and new requests UNAVAILABLE on both fronts, while the
    request in flight on each finishes whole; the front process then exits 0."""
    long = 600

    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 2), api_processes=2,
                                   drain_timeout_s=20.0) as mesh:
            (a,), (b,) = await clients_on(mesh, 0, 1), await clients_on(mesh, 1, 1)
            process = mesh.app.fronts.procs[1]
            streams = [c.generate(prompt="long", max_tokens=long, ignore_eos=True)
                       for c in (a, b)]
            received = [len((await s.__anext__()).token_ids) for s in streams]

            drain = asyncio.create_task(mesh.app.drain_and_stop())
            for client in (a, b):
                assert await readiness_gone(client), "readiness stayed SERVING"
                assert await client.health("liveness")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.complete(prompt="late", max_tokens=4)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in (info.value.details() or "")
            assert (await a.stats()).num_running == 2  # both still in flight

            finish = []
            for i, stream in enumerate(streams):
                async for chunk in stream:
                    received[i] += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        finish.append(chunk.finish_reason)
            assert received == [long, long] and finish == ["length", "length"]
            await drain
            assert process.returncode == 0
            await close_all([a, b])

    asyncio.run(run())


def test_api_keys_on_every_front(model_dir: Path) -> None:
    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 1), api_processes=2,
                                   api_keys=frozenset({"k1"})) as mesh:
            anonymous = [mesh.client(own_connection=True) for _ in range(12)]
            for client in anonymous:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.complete(prompt="hi", max_tokens=2)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert await client.health("readiness")  # health stays open
            keyed = [RouterClient(mesh.address, metadata=[("authorization", "Bearer k1")],
                                  own_connection=True) for _ in range(12)]
            await asyncio.gather(*(c.complete(prompt="hi", max_tokens=2, ignore_eos=True)
                                   for c in keyed))
            stats = await mesh.app.front.stats()
            assert sum(stats.finished_by_front.values()) == 12
            await close_all(anonymous + keyed)

    asyncio.run(run())


def test_mutual_tls_on_every_front(model_dir: Path, tmp_path: Path) -> None:
    """The front process gets the TLS key and the client CA (on stdin) and serves mutual TLS
    like front 0: a client with a certificate the CA signed is served on both."""
    pki = write_pki(tmp_path)
    tls = server_tls(pki.server_cert, pki.server_key, pki.ca)
    creds = client_tls(pki.ca, pki.client_cert, pki.client_key)
    assert creds is not None

    async def run() -> None:
        async with in_process_mesh(null_stages(model_dir, 1), api_processes=2,
                                   tls=tls) as mesh:
            def make() -> RouterClient:
                return RouterClient(mesh.address, creds.credentials(), own_connection=True)

            clients = [*await clients_on(mesh, 0, 1, make), *await clients_on(mesh, 1, 1, make)]
            for client in clients:
                out = await client.complete(prompt="hi", max_tokens=3, ignore_eos=True)
                assert out.finish_reasons == ["length"]
            await close_all(clients)

    asyncio.run(run())
