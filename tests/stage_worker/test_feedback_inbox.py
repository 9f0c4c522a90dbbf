"""The first stage's end of the feedback link, read by the taker itself: a take reads the
link while its step is missing, a step that took nothing takes in what arrived without
waiting, and a link that fails or is replaced under a waiting take ends the wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from stage_worker.dataplane import TcpTransport
from stage_worker.feedback import FeedbackInbox, FeedbackMissingError, FeedbackStore
from tests.stage_worker.dataplane_helpers import linked_pair

Link = tuple[TcpTransport, FeedbackStore, FeedbackInbox]


@pytest.fixture
def receiver_end() -> Iterator[tuple[TcpTransport, TcpTransport]]:
    sender, receiver = linked_pair()
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()


@pytest.fixture
def link(receiver_end: tuple[TcpTransport, TcpTransport]) -> Link:
    """(the last stage's sending end, the first stage's store, its inbox on the other end)."""
    sender, receiver = receiver_end
    store = FeedbackStore()
    inbox = FeedbackInbox(store)
    inbox.attach(receiver)
    return sender, store, inbox


def _send(sender: TcpTransport, step_id: int, seq_ids: tuple[int, ...]) -> None:
    """Step `step_id`'s feedback: each sequence sampled its id times 10 plus the step."""
    sender.send_ints(step_id, [seq_ids, [10 * s + step_id for s in seq_ids]])


def test_a_take_reads_the_link_itself_and_no_thread_does(
        link: Link) -> None:
    sender, store, _ = link
    assert not [t for t in threading.enumerate() if t.name == "feedback-recv"]
    _send(sender, 0, (1, 2))
    _send(sender, 1, (1, 2))
    # Step 2 still to come when the take starts: it reads steps 0 and 1 on its way.
    threading.Timer(0.05, _send, [sender, 2, (2, 1)]).start()
    assert store.take_aligned(5, (2, 1), (2, 2), timeout_s=5) == (22, 12)
    assert store.take(6, [(1, 0), (2, 1)], timeout_s=0.1) == {1: 10, 2: 21}


def test_a_step_that_took_nothing_takes_in_what_arrived_without_waiting(
        link: Link) -> None:
    sender, store, inbox = link
    started = time.monotonic()
    store.settle(timeout_s=5)  # nothing arrived: no wait
    assert time.monotonic() - started < 0.5
    for step in range(3):
        _send(sender, step, (4,))
    while not inbox.ready():
        time.sleep(0.005)
    time.sleep(0.05)  # all three on this end
    store.settle(timeout_s=5)
    assert [store.get(step) is not None for step in range(3)] == [True, True, True]
    assert not inbox.ready()


def test_a_take_leaves_the_link_to_the_next_take(
        link: Link) -> None:
    """A step that took its tokens does not read on: the messages after them wait for the
    next take (settle only reads after a step that took nothing)."""
    sender, store, inbox = link
    _send(sender, 0, (3,))
    assert store.take(1, [(3, 0)], timeout_s=5) == {3: 30}
    _send(sender, 1, (3,))
    while not inbox.ready():
        time.sleep(0.005)
    store.settle(timeout_s=5)  # this step took: nothing more is read
    assert store.get(1) is None and inbox.ready()
    store.settle(timeout_s=5)  # the next step took nothing: it takes step 1 in
    assert store.get(1) is not None


def test_a_link_failing_under_a_waiting_take_fails_it_at_once(
        link: Link) -> None:
    sender, store, _ = link
    threading.Timer(0.1, sender.close).start()
    started = time.monotonic()
    with pytest.raises(FeedbackMissingError, match="step 4: the tokens sampled at step 3 "
                                                   "cannot come: feedback link failed"):
        store.take(4, [(1, 3)], timeout_s=10)
    assert time.monotonic() - started < 5


def test_a_new_link_replaces_the_one_a_take_waits_on(
        link: Link, receiver_end: tuple[TcpTransport, TcpTransport]) -> None:
    """A re-link (a new epoch) closes the old link and attaches the new one: a take that
    waited on the old one reads the new one, whose steps start afresh."""
    old_sender, store, inbox = link
    _send(old_sender, 0, (5,))
    new_sender, new_receiver = linked_pair()
    try:
        def relink() -> None:
            inbox.attach(new_receiver)
            receiver_end[1].close()  # the links close the old epoch's
            _send(new_sender, 7, (5,))

        threading.Timer(0.1, relink).start()
        assert store.take(8, [(5, 7)], timeout_s=5) == {5: 57}
        assert store.get(0) is None  # the old link's steps went with it
    finally:
        new_sender.close()
        new_receiver.close()
