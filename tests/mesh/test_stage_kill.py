"""SIGKILL of the first, the middle and the last stage of a 3-stage pipeline, each while 16
greedy streams run (real processes: `stagemesh serve`, the default model on CPU). What
brings the stage back is serve's own restart, as Kubernetes would restart a pod; the
router re-links the data plane and re-prefills. Every stream must end with exactly the text
of a fault-free run, and KV must return to idle on the router and on every stage."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from router.client import RouterClient
from tests.default_model import default_model_dir
from tests.mesh.harness import SERVING, Mesh, readiness, wait_idle, wait_status

pytestmark = pytest.mark.slow

STREAMS, TOKENS = 16, 24
PROMPTS = [f"Write one sentence about the number {i}." for i in range(STREAMS)]


async def _streams(address: str, kill_mid_stream: int | None, mesh: Mesh) -> list[str]:
    """Every prompt's greedy text; with `kill_mid_stream`, that stage is SIGKILLed once
    every stream has its first tokens."""
    async with RouterClient(address) as client:
        counts = [0] * STREAMS
        all_started = asyncio.Event()

        async def one(i: int) -> str:
            text = ""
            async for chunk in client.generate(
                    messages=[{"role": "user", "content": PROMPTS[i]}], temperature=0.0,
                    max_tokens=TOKENS, ignore_eos=True, timeout=300):
                text += chunk.text
                counts[i] += len(chunk.token_ids)
                if min(counts) >= 4:
                    all_started.set()
            return text

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        if kill_mid_stream is not None:
            await asyncio.wait_for(all_started.wait(), 120)
            os.kill(mesh.pid(f"stage {kill_mid_stream}"), signal.SIGKILL)
        return list(await asyncio.gather(*tasks))


def test_sigkill_of_any_stage_of_three_loses_no_stream() -> None:
    with Mesh("--model", str(default_model_dir()), "--stages", "3", "--num-blocks", "256",
              "--recovery-budget", "120", "--step-timeout", "10", timeout=300) as mesh:
        want = asyncio.run(_streams(mesh.address, None, mesh))
        assert len(set(want)) > 1  # the prompts give different texts
        stub = mesh.stub()
        for victim in (0, 1, 2):
            before = mesh.pid(f"stage {victim}")
            got = asyncio.run(_streams(mesh.address, victim, mesh))
            assert got == want, f"stage {victim} killed"
            assert mesh.pid(f"stage {victim}") != before  # serve restarted it
            wait_status(mesh.address, SERVING, 60)
            stats = wait_idle(stub, timeout=60)
            assert len(stats.stages) == 3
        assert readiness(mesh.address) == SERVING
