"""Faults inside a running mesh, in process (real gRPC servers, the real data plane: a unix
link, the stages sharing a host; the null model, whose last stage answers token (seq_id +
tokens already output) mod vocab, so a stream's fault-free tokens are known): a data-plane
link cut under a live pipeline, and a last stage that answers with a wrong step id. Each is
detected and named (the pipeline goes down), the router re-links and re-prefills, and every
stream ends with its fault-free tokens; KV returns to idle on the router and on every
stage."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from router.client import Completion
from stage_worker import service
from tests.default_model import default_model_dir
from tests.router.inprocess import InProcessMesh, in_process_mesh, stage_configs
from tests.router.test_engine_inprocess import wait_idle

STREAMS, TOKENS = 8, 120


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


async def _run(mesh: InProcessMesh, fault: Any) -> list[Completion]:
    """STREAMS greedy requests; `fault()` once every stream has 10 tokens."""
    async with mesh.client() as client:
        counts = [0] * STREAMS
        going = asyncio.Event()

        async def one(i: int) -> Completion:
            out = Completion(texts=[""], token_ids=[[]], finish_reasons=[None])
            async for chunk in client.generate(prompt=f"request {i}", max_tokens=TOKENS,
                                               ignore_eos=True, temperature=0.0, timeout=60):
                if chunk.usage is None:
                    out.token_ids[0] += chunk.token_ids
                    out.finish_reasons[0] = chunk.finish_reason
                    counts[i] = len(out.token_ids[0])
                    if min(counts) >= 10:
                        going.set()
            return out

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        await asyncio.wait_for(going.wait(), 30)
        fault()
        outs = list(await asyncio.gather(*tasks))
        await wait_idle(client, mesh.stage_sequences, timeout=30)
        return outs


def _fault_free(outs: list[Completion], vocab: int) -> None:
    """The null model's tokens: consecutive from the sequence's id, whatever happened."""
    for out in outs:
        tokens = out.token_ids[0]
        assert len(tokens) == TOKENS and out.finish_reasons == ["length"]
        assert tokens == [(tokens[0] + j) % vocab for j in range(TOKENS)]


def _mesh(model_dir: Path) -> Any:
    stages = stage_configs(model_dir, 2, model_impl="null", num_blocks=512, step_timeout_s=5.0)
    return in_process_mesh(stages, step_timeout_s=5.0, recovery_budget_s=30.0)


def test_a_data_plane_link_cut_under_a_live_pipeline_is_recovered(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> tuple[list[Completion], int]:
        async with _mesh(model_dir) as mesh:
            links = mesh.stages[0].servicer.leader.links

            def cut() -> None:  # the socket closed under the pipeline, mid-stream
                link = links._downstream
                assert link is not None
                link.close()
            outs = await _run(mesh, cut)
            return outs, mesh.stages[0].servicer.identity.vocab_size

    with caplog.at_level(logging.INFO):
        outs, vocab = asyncio.run(body())
    _fault_free(outs, vocab)
    down = [r.getMessage() for r in caplog.records if "pipeline down" in r.getMessage()]
    assert down, "the cut was never detected"
    assert any("epoch 2" in r.getMessage() for r in caplog.records)  # re-linked


def test_a_wrong_step_id_in_an_answer_is_refused_and_recovered(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    answers = [0]
    right = service.outcome_to_proto

    def confused(outcome: Any) -> pb.StepResult:
        result = right(outcome)
        answers[0] += 1
        if answers[0] == 40:  # once, mid-stream: a step id the router did not expect
            result.step_id += 7
        return result

    monkeypatch.setattr(service, "outcome_to_proto", confused)

    async def body() -> tuple[list[Completion], int]:
        async with _mesh(model_dir) as mesh:
            outs = await _run(mesh, lambda: None)
            return outs, mesh.stages[0].servicer.identity.vocab_size

    with caplog.at_level(logging.INFO):
        outs, vocab = asyncio.run(body())
    _fault_free(outs, vocab)
    down = [r.getMessage() for r in caplog.records if "pipeline down" in r.getMessage()]
    assert len(down) == 1 and "where step" in down[0], down
