"""SIGTERM during a beam search: the router's drain waits for the search (it has no request
on the front between two steps), which finishes whole."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from router.client import RouterClient
from tests.mesh.harness import Mesh

pytestmark = pytest.mark.slow

LONG = 24  # tokens of each beam


def test_a_beam_search_in_flight_finishes_while_the_router_drains() -> None:
    mesh = Mesh("--stages", "1", "--num-blocks", "128")
    try:
        async def run() -> list[tuple[str | None, int]]:
            async with RouterClient(mesh.address) as client:
                search = asyncio.create_task(client.complete(
                    prompt="Once upon a time", max_tokens=LONG, ignore_eos=True, n=2,
                    beam_search={"beam_width": 2}))
                while (await client.stats()).requests_finished < 4:  # two steps done
                    await asyncio.sleep(0.02)
                os.kill(mesh.pids["router"], signal.SIGTERM)
                done = await search
                return list(zip(done.finish_reasons, map(len, done.token_ids), strict=True))

        assert asyncio.run(run()) == [("length", LONG), ("length", LONG)]
    finally:
        mesh.close()
