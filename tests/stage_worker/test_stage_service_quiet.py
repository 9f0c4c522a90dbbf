"""A stage that is not the last answers only a failed step: its Run stream wakes the event
loop for a failure or the stream's end, never per step (`stage_worker.service`'s
`QuietProgress`). Stage 0 of 2 here, its activations read by the test on a real
data-plane link."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from stage_worker.config import StageConfig
from stage_worker.dataplane import TcpListener, Transport, TransportError
from stage_worker.run_state import QuietProgress
from stage_worker.service import MAX_QUEUED_STEPS
from tests.stage_worker.stage_service_harness import (
    RunStream,
    decodes,
    prefill,
    service_checkpoint,
    serving,
)

TOKEN = bytes(range(32))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return service_checkpoint(tmp_path_factory)


def _prefill(step: int, seq_id: int) -> pb.StepPlan:
    plan = prefill([seq_id], [[1, 2, 3]], [[seq_id]])
    plan.step_id = step
    return plan


async def _run_first_of_two(checkpoint: Path, plans: list[pb.StepPlan]
                            ) -> tuple[list[pb.StepResult], list[int]]:
    """`plans` written ahead on stage 0 of 2 (null model) whose downstream link is the test's
    listener; (every result of the stream, the step ids whose activations came down)."""
    cfg = StageConfig(checkpoint, model_impl="null", stage_index=0, num_stages=2,
                      step_timeout_s=20.0)
    received: list[int] = []
    with TcpListener("127.0.0.1", token=TOKEN) as listener:
        def drain() -> None:
            link: Transport = listener.accept(10)
            try:
                while True:
                    step_id, _ = link.recv_any(timeout_s=10)
                    received.append(step_id)
            except TransportError:  # the stage closed the link: the test is over
                pass
            finally:
                link.close()

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        async with serving(cfg) as stub:
            await stub.Connect(pb.ConnectRequest(
                role=pb.LINK_ROLE_CONNECT_DOWNSTREAM, epoch=1, link_token=TOKEN,
                address=f"127.0.0.1:{listener.address[1]}"))
            call = RunStream(stub)
            for plan in plans:
                await call.write(plan)
            await call.done_writing()
            results = []
            while (result := await call.read()) is not grpc.aio.EOF:
                assert isinstance(result, pb.StepResult)
                results.append(result)
        thread.join(10)
    return results, received


def test_steps_that_succeed_are_not_answered(checkpoint: Path) -> None:
    plans = [_prefill(step, seq_id=step) for step in range(MAX_QUEUED_STEPS + 4)]
    results, received = asyncio.run(_run_first_of_two(checkpoint, plans))
    assert results == []  # the stream ended (after its steps ran) with nothing to answer
    assert received == list(range(MAX_QUEUED_STEPS + 4))


def test_a_refused_step_is_answered_and_the_steps_behind_it_are_skipped(
        checkpoint: Path) -> None:
    plans = [_prefill(0, 1), _prefill(1, 2), decodes(2, [(9, 3, 5)]), _prefill(3, 3),
             _prefill(4, 4)]
    results, received = asyncio.run(_run_first_of_two(checkpoint, plans))
    assert [r.step_id for r in results] == [2]
    assert results[0].error.startswith("stage 0: PlanError: step 2, sequence 9 is not held")
    assert received == [0, 1]  # steps 3 and 4 never ran


def test_a_plan_that_does_not_convert_is_answered_after_the_steps_before_it(
        checkpoint: Path) -> None:
    bad = decodes(2, [(1, 3, 1), (2, 3, 2)])
    bad.cached_batch.num_new = bad.cached_batch.num_new[:4]
    results, received = asyncio.run(_run_first_of_two(
        checkpoint, [_prefill(0, 1), _prefill(1, 2), bad, _prefill(3, 3)]))
    assert [r.step_id for r in results] == [2]
    assert "cached_batch.num_new holds 1 int32s for 2 sequences" in results[0].error
    assert received == [0, 1]


def test_the_backlog_wait_ends_when_the_worker_catches_up() -> None:
    """The loop waits only while the backlog is over the bound; the worker's counting wakes
    it without a lost wake-up, however the two interleave."""
    async def body() -> list[int]:
        progress = QuietProgress(asyncio.get_running_loop())
        progress.submitted = 40
        seen: list[int] = []

        def worker() -> None:
            for _ in range(40):
                time.sleep(0.0005)
                progress.step_done()

        thread = threading.Thread(target=worker)
        thread.start()
        for bound in (30, 12, 0):
            await asyncio.wait_for(progress.wait_until_backlog(bound), 10)
            seen.append(progress.backlog)
            assert progress.backlog <= bound
        thread.join()
        return seen

    assert asyncio.run(body())[-1] == 0


def test_a_failure_ends_the_backlog_wait() -> None:
    async def body() -> tuple[int, BaseException] | None:
        progress = QuietProgress(asyncio.get_running_loop())
        progress.submitted = 3
        threading.Timer(0.05, progress.fail_from_worker, (7, ValueError("boom"))).start()
        await asyncio.wait_for(progress.wait_until_backlog(0), 10)
        await asyncio.wait_for(progress.failure, 10)
        return progress.first_failure

    failure = asyncio.run(body())
    assert failure is not None
    step_id, error = failure
    assert step_id == 7 and str(error) == "boom"


def test_a_failed_step_counted_finished_is_seen_failed_before_the_loop_hears() -> None:
    """The worker fails the last step and counts it finished before the loop runs its
    notice: a loop that then finds the backlog empty must still see the failure (it would
    otherwise end the stream unanswered)."""
    async def body() -> tuple[int, BaseException] | None:
        progress = QuietProgress(asyncio.get_running_loop())
        progress.submitted = 1
        progress.fail_from_worker(4, ValueError("late"))  # its notice is not run yet
        progress.step_done()
        await progress.wait_until_backlog(0)  # returns at once: nothing unfinished
        assert not progress.failure.done()
        return progress.first_failure

    failure = asyncio.run(body())
    assert failure is not None and failure[0] == 4
