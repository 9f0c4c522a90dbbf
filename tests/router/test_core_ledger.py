"""The engine core's ledger: request ids unique across fronts while live, finished requests
counted once (in all and by front), aborts not counted, a dead front's sequences ended."""

from __future__ import annotations

from router.core.ledger import Ledger
from router.core.messages import (
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP,
    NOT_LIVE,
    SEQ_ID_FRONT_SHIFT,
)

FRONT1 = 1 << SEQ_ID_FRONT_SHIFT


def test_a_request_id_is_live_until_its_last_sequence_ends() -> None:
    ledger = Ledger()
    ledger.add("a", [1, 2], max_tokens=4, stop_ids=frozenset(), logprobs=[False, False])
    assert ledger.is_live("a") and not ledger.is_live("b")
    assert ledger.end(1, aborted=False) is not None
    assert ledger.is_live("a")  # choice 2 still runs
    assert ledger.end(1, aborted=False) is None  # once only
    ledger.end(2, aborted=False)
    assert not ledger.is_live("a")
    assert (ledger.requests_finished, ledger.finished_by_front) == (1, {0: 1})


def test_an_aborted_choice_keeps_its_request_from_counting() -> None:
    ledger = Ledger()
    ledger.add("a", [1, 2], max_tokens=4, stop_ids=frozenset(), logprobs=[False, False])
    ledger.end(1, aborted=False)
    ledger.end(2, aborted=True)
    assert not ledger.is_live("a") and ledger.requests_finished == 0


def test_verdicts_and_a_gone_front() -> None:
    ledger = Ledger()
    ledger.add("a", [1], max_tokens=2, stop_ids=frozenset({7}), logprobs=[False])
    ledger.add("b", [FRONT1 + 1], max_tokens=2, stop_ids=frozenset(), logprobs=[True])
    ledger.add("c", [FRONT1 + 2], max_tokens=9, stop_ids=frozenset(), logprobs=[False])
    b, c = FRONT1 + 1, FRONT1 + 2
    assert ledger.settle([1, b, c], [5, 5, 5], set()) == ([FINISH_NONE] * 3, [b])
    # A stop token, max_tokens, the context limit; and a sequence no longer live.
    assert ledger.settle([1, b, c, 8], [7, 5, 5, 5], {c}) == (
        [FINISH_STOP, FINISH_LENGTH, FINISH_LENGTH, NOT_LIVE], [b])
    assert not ledger.rules
    assert ledger.finished_by_front == {0: 1, 1: 2}
    ledger.add("d", [FRONT1 + 3], max_tokens=9, stop_ids=frozenset(), logprobs=[False])
    ledger.add("e", [3], max_tokens=9, stop_ids=frozenset(), logprobs=[False])
    assert ledger.abort_all(front=1) == [FRONT1 + 3]
    assert list(ledger.rules) == [3] and not ledger.is_live("d") and ledger.is_live("e")
    assert ledger.requests_finished == 3
