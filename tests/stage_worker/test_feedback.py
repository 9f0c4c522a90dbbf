"""The run-ahead feedback path: the first stage's store of sampled tokens, the device-side
gather of a one-stage pipeline, and the feedback link between two stage leaders (token
checked, a missing step named)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from stage_worker.build import build_stage_rank
from stage_worker.config import StageConfig
from stage_worker.dataplane import LinkRefusedError
from stage_worker.feedback import (
    FeedbackMissingError,
    FeedbackStore,
    StepTokens,
    device_inputs,
    gather_device_inputs,
)
from stage_worker.leader import StageLeader
from stage_worker.parallel import TPGroup
from stage_worker.plan import StageCachedSeq, StageNewSeq, StagePlan
from tests.default_model import default_model_dir

TOKEN, WRONG = b"f" * 32, b"w" * 32


def test_take_waits_for_a_step_that_is_still_coming() -> None:
    store = FeedbackStore()
    store.put(StepTokens(3, (1, 2), (10, 20)))
    later = threading.Timer(0.05, store.put, [StepTokens(4, (2,), (21,))])
    later.start()
    assert store.take(9, [(2, 4), (1, 3)], timeout_s=5) == {2: 21, 1: 10}
    later.join()


@pytest.mark.parametrize(("wants", "error"), [
    ([(1, 6)], "step 9: the tokens sampled at step 6 did not arrive from the last stage "
               "within 0.05s"),
    ([(1, 4)], "step 9: the tokens sampled at step 4 never came or were dropped (the newest "
               "step received is 5)"),
    ([(7, 5)], "step 9: sequence 7 takes its input from step 5, which sampled no token"),
], ids=["timeout", "skipped", "no-such-sequence"])
def test_a_missing_input_names_both_steps(wants: list[tuple[int, int]], error: str) -> None:
    store = FeedbackStore()
    store.put(StepTokens(5, (1,), (10,)))
    started = time.monotonic()
    with pytest.raises(FeedbackMissingError, match=re.escape(error)):
        store.take(9, wants, timeout_s=0.05)
    assert time.monotonic() - started < 2


def test_aligned_tokens_come_in_the_asked_order_whatever_the_steps() -> None:
    store = FeedbackStore()
    store.put(StepTokens(3, (1, 2, 5), (10, 20, 50)))
    store.put(StepTokens(4, (7,), (70,)))
    # One step, the order it sampled in: its own tuple, not a copy built per sequence.
    assert store.take_aligned(9, (1, 2, 5), (3, 3, 3), timeout_s=5) is store.get(3).token_ids
    # Another order, a subset, two steps: looked up per sequence, in the order asked.
    assert store.take_aligned(9, (5, 1), (3, 3), timeout_s=5) == (50, 10)
    assert store.take_aligned(9, (7, 2), (4, 3), timeout_s=5) == (70, 20)
    with pytest.raises(FeedbackMissingError, match="sequence 8 takes its input from step 4"):
        store.take_aligned(9, (7, 8), (4, 4), timeout_s=5)
    with pytest.raises(FeedbackMissingError, match="step 9: the tokens sampled at step 6 "
                                                   "did not arrive"):
        store.take_aligned(9, (1,), (6,), timeout_s=0.05)


def test_a_broken_link_wakes_the_waiter_and_old_steps_are_dropped() -> None:
    store = FeedbackStore(keep=2)
    for k in range(4):
        store.put(StepTokens(k, (1,), (k,)))
    assert store.get(1) is None and store.get(3) is not None
    threading.Timer(0.05, store.break_with, ["feedback link failed: reset"]).start()
    with pytest.raises(FeedbackMissingError, match="step 8: the tokens sampled at step 7 "
                                                   "cannot come: feedback link failed: reset"):
        store.take(8, [(1, 7)], timeout_s=30)


def test_device_inputs_come_from_the_ids_kept_on_the_device() -> None:
    store = FeedbackStore()
    # The device copy stands for the truth; the host tuples deliberately disagree.
    store.put(StepTokens(2, (5, 6, 7), (0, 0, 0), torch.tensor([50, 60, 70])))
    store.put(StepTokens(4, (9,), None, torch.tensor([90])))  # not on the host yet
    store.put(StepTokens(3, (8,), (80,)))  # came over a link: no device ids
    inputs = torch.tensor([1, 2, 3, 4, 5])
    gather_device_inputs(inputs, [(4, 6, 2), (0, 7, 2), (3, 9, 4)], store)
    assert inputs.tolist() == [70, 2, 3, 90, 60]
    with pytest.raises(FeedbackMissingError, match="tokens sampled at step 3 are not on the "
                                                   "device"):
        gather_device_inputs(inputs, [(2, 8, 3)], store)
    with pytest.raises(ValueError, match="step 5: tokens neither on the host nor on the device"):
        StepTokens(5, (1,), None)


def test_a_steady_steps_inputs_copy_the_ids_of_its_step_and_any_other_gathers() -> None:
    store = FeedbackStore()
    ids = torch.tensor([50, 60, 70])
    store.put(StepTokens(2, (5, 6, 7), None, ids))
    cpu = torch.device("cpu")
    # Every row from step 2, in its order: a copy of its ids (not the kept tensor itself).
    got = device_inputs([0, 0, 0], [(0, 5, 2), (1, 6, 2), (2, 7, 2)], store, cpu)
    assert got.tolist() == [50, 60, 70] and got.data_ptr() != ids.data_ptr()
    # Another order, a row not run-ahead, or none: the host ids with the rows gathered.
    assert device_inputs([0, 0, 0], [(0, 7, 2), (1, 6, 2), (2, 5, 2)], store,
                         cpu).tolist() == [70, 60, 50]
    assert device_inputs([9, 0, 0], [(1, 5, 2), (2, 6, 2)], store, cpu).tolist() == [9, 50, 60]
    assert device_inputs([1, 2], [], store, cpu).tolist() == [1, 2]


def _leader(stage_index: int) -> StageLeader:
    cfg = StageConfig(default_model_dir(), stage_index=stage_index, num_stages=2,
                      model_impl="null", step_timeout_s=0.5)
    return StageLeader(build_stage_rank(cfg, TPGroup()), step_timeout_s=0.5)


@pytest.fixture
def leaders() -> Iterator[tuple[StageLeader, StageLeader]]:
    first, last = _leader(0), _leader(1)
    try:
        first.connect_downstream(last.listen_upstream("127.0.0.1", TOKEN, 0), TOKEN, 0)
        yield first, last
    finally:
        first.shutdown()
        last.shutdown()


def _wait(condition: object, what: str) -> None:
    deadline = time.monotonic() + 5
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_feedback_link_refuses_a_wrong_token_and_carries_the_tokens(
        leaders: tuple[StageLeader, StageLeader]) -> None:
    first, last = leaders
    address = first.listen_feedback("127.0.0.1", TOKEN, 0)
    with pytest.raises(LinkRefusedError, match="refused the link token"):
        last.connect_feedback(address, WRONG, 0)
    last.connect_feedback(address, TOKEN, 0)
    _wait(lambda: first.links.has_feedback and first.linked and last.linked, "links")
    with pytest.raises(ValueError, match="only the first stage"):
        last.listen_feedback("127.0.0.1", TOKEN, 0)

    prefill = StagePlan(0, (StageNewSeq(9, (1, 2, 3), 3, (0,), 0, 3, True, None),), (), ())
    first.run_step(prefill)
    sampled = last.run_step(prefill).sampled  # the null model: (9 + 0) mod vocab
    assert sampled == {9: 9}
    ahead = StagePlan(1, (), (StageCachedSeq(9, (), 3, 1, (), True, 0),), ())
    first.run_step(ahead)
    assert first.rank.held.seqs[9].token_ids == [1, 2, 3, 9]
    assert last.run_step(ahead).sampled == {9: 10}
    assert last.rank.held.seqs[9].token_ids == [1, 2, 3, 9]

    # Step 2 names step 1, whose tokens the first stage has; step 3 names step 2, which the
    # last stage never runs: it fails within the step timeout, naming both steps.
    first.run_step(StagePlan(2, (), (StageCachedSeq(9, (), 4, 1, (), True, 1),), ()))
    assert first.rank.held.seqs[9].token_ids[-1] == 10
    with pytest.raises(FeedbackMissingError, match=r"step 3: the tokens sampled at step 2 did "
                                                   r"not arrive from the last stage within 0.5s"):
        first.run_step(StagePlan(3, (), (StageCachedSeq(9, (), 5, 1, (), True, 2),), ()))
