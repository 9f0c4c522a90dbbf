"""A stage that hangs (SIGSTOP) is caught by the step timeout, not waited on for ever; once
it runs again the router re-links and the request finishes with the fault-free text.

What marks the pipeline down must be the step timeout (3 s here), not the gRPC keepalive on
the stage channels (a ping every 10 s, 5 s to answer), which would also notice a stopped
process: the router's log must name the step that got no result, and nothing else may have
marked the pipeline down first."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from router.client import RouterClient
from tests.mesh.harness import Mesh, readiness, wait_idle

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Tell me about mountains."}]


def test_sigstop_is_detected_by_the_step_timeout() -> None:
    with Mesh("--stages", "2", "--num-blocks", "256", "--step-timeout", "3") as mesh:
        async def generate() -> str:
            async with RouterClient(mesh.address) as client:
                out = await client.complete(messages=PROMPT, temperature=0.0, max_tokens=80,
                                            ignore_eos=True, timeout=300)
                return out.texts[0]

        want = asyncio.run(generate())

        async def with_hang() -> tuple[str, float]:
            task = asyncio.create_task(generate())
            await asyncio.sleep(0.5)
            pid = mesh.pids["stage 1"]
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                while readiness(mesh.address) != 2:  # NOT_SERVING once the timeout fires
                    assert time.monotonic() - stopped < 30, "hang never detected"
                    await asyncio.sleep(0.2)
                detected = time.monotonic() - stopped
            finally:
                os.kill(pid, signal.SIGCONT)
            return await task, detected

        text, detected = asyncio.run(with_hang())
        assert text == want
        downs = [line for line in mesh.proc.lines if "pipeline down:" in line]
        assert downs, "the pipeline was never marked down"
        assert re.search(r"pipeline down: step \d+ got no result within 3s", downs[0]), downs
        assert detected < 10  # before the first keepalive ping could even be sent
        wait_idle(mesh.stub())
