"""Stop strings on streamed text: held back until decided, cut at the first stop, the same
result however the text is split into deltas."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundation.tokenizer import ModelTokenizer
from router.detokenizer import IncrementalDetokenizer
from router.stop import StopChecker
from tests.default_model import default_model_dir


def _run(checker: StopChecker, deltas: Sequence[str]) -> tuple[list[str], bool]:
    """What each delta emits, then the flush if no stop was found; and whether one was."""
    out, stopped = [], False
    for d in deltas:
        text, stopped = checker.process(d)
        out.append(text)
        if stopped:
            return out, True
    return [*out, checker.flush()], False


def _reference(text: str, stop: Sequence[str], include: bool) -> tuple[str, bool]:
    """Cut text at the first prefix that ends with a stop string (the longest one there)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[:end] if include else text[:end - len(s)], True
    return text, False


# (stop strings, include_in_output, deltas, what each delta emits (+ the flush), stopped)
CASES = [
    pytest.param(["STOP"], False, ["Hel", "lo S", "T", "O", "P and more"],
                 ["Hel", "lo ", "", "", ""], True, id="split-over-many-deltas"),
    pytest.param(["STOP"], True, ["Hel", "lo S", "T", "O", "P and more"],
                 ["Hel", "lo ", "", "", "STOP"], True, id="split-include"),
    pytest.param(["STOP"], False, ["a S", "T", "x", " done"], ["a ", "", "STx", " done", ""],
                 False, id="false-start-released"),
    pytest.param(["ab", "abc"], False, ["xa", "bc"], ["x", ""], True,
                 id="overlap-shorter-ends-first"),
    pytest.param(["ab", "abc"], True, ["xa", "bcd"], ["x", "ab"], True, id="overlap-include"),
    pytest.param(["bc", "abc"], True, ["xab", "c!"], ["x", "abc"], True,
                 id="same-end-longest-wins-include"),
    pytest.param(["bc", "abc"], False, ["xab", "c!"], ["x", ""], True,
                 id="same-end-longest-wins"),
    pytest.param(["<end>"], False, ["<end> tail"], [""], True, id="at-the-very-start"),
    pytest.param(["<end>"], False, ["<", "end", ">"], ["", "", ""], True, id="start-split"),
    pytest.param(["\n\n", "###", "User:"], False, ["one\n", "two ##", "# three"],
                 ["one", "\ntwo ", ""], True, id="multiple-second-matches"),
    pytest.param(["\n\n", "###", "User:"], False, ["a\nUse", "r: hi\n\n"], ["a\n", ""], True,
                 id="multiple-first-matches"),
    pytest.param(["END"], False, ["the E", "N"], ["the ", "", "EN"], False,
                 id="held-released-at-finish"),
    pytest.param([], False, ["no ", "stops"], ["no ", "stops", ""], False, id="no-stop-strings"),
    pytest.param(["🎉"], False, ["party ", "🎉", " time"], ["party ", ""], True, id="emoji"),
    pytest.param(["aab"], False, ["aa", "a", "ab"], ["", "a", "a"], True, id="self-overlap"),
]


@pytest.mark.parametrize(("stop", "include", "deltas", "emitted", "stopped"), CASES)
def test_stop_cases(stop: list[str], include: bool, deltas: list[str], emitted: list[str],
                    stopped: bool) -> None:
    checker = StopChecker(stop, include)
    assert _run(checker, deltas) == (emitted, stopped)
    assert checker.stopped is stopped
    assert _reference("".join(deltas), stop, include) == ("".join(emitted), stopped)


def test_after_a_stop_everything_is_dropped() -> None:
    checker = StopChecker(["x"])
    assert checker.process("ax") == ("a", True)
    assert checker.matched == "x"
    assert checker.process("more") == ("", True)
    assert checker.flush() == ""


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        StopChecker(["ok", ""])


@settings(max_examples=400, deadline=None)
@given(text=st.text("ab c", max_size=30),
       stop=st.lists(st.text("ab c", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=10), include=st.booleans())
def test_any_split_gives_the_reference(text: str, stop: list[str], cuts: list[int],
                                       include: bool) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    checker = StopChecker(stop, include)
    held_max = max((len(s) - 1 for s in stop), default=0)
    emitted, stopped = [], False
    for i, d in enumerate(deltas):
        out, stopped = checker.process(d)
        emitted.append(out)
        if stopped:
            break
        # Never holds more than a stop string's proper prefix.
        assert len("".join(deltas[:i + 1])) - len("".join(emitted)) <= held_max
    if not stopped:
        emitted.append(checker.flush())
    assert ("".join(emitted), stopped) == _reference(text, stop, include)


def test_stop_string_through_the_real_detokenizer() -> None:
    """Tokens -> IncrementalDetokenizer -> StopChecker, token by token, with a stop string
    that is an emoji spread over three tokens and a false start before it."""
    tok = ModelTokenizer.from_dir(default_model_dir())
    full = "Let's 🎈 then 你好 🎉 and never this"
    ids = tok.encode(full)
    detok = IncrementalDetokenizer(tok.tokenizer, tok.encode("Say:"), True)
    checker = StopChecker(["好 🎉", "🎊"])
    out, stopped = [], False
    for t in ids:
        text, stopped = checker.process(detok.push(t))
        out.append(text)
        if stopped:
            break
    assert stopped and checker.matched == "好 🎉"
    assert "".join(out) == "Let's 🎈 then 你"


def test_a_choice_names_what_stopped_it() -> None:
    """`ChoiceDelta.stop_reason`: the stop string, or a stop token id of the request; None
    for EOS and for a length finish."""
    from router.choice import ChoiceState
    from router.scheduler import FinishReason

    tok = ModelTokenizer.from_dir(default_model_dir())
    ids = tok.encode("one two three four")
    prompt = tuple(tok.encode("Count:"))

    def run(stop: tuple[str, ...], verdicts: dict[int, FinishReason],
            stop_ids: tuple[int, ...] = ()) -> tuple[FinishReason | None, str | int | None]:
        choice = ChoiceState(0, 1, tok.tokenizer, prompt, stop, False, True,
                             stop_token_ids=stop_ids)
        for i, t in enumerate(ids):
            delta = choice.on_token(t, None, verdicts.get(i))
            if delta is not None and delta.finish_reason is not None:
                return delta.finish_reason, delta.stop_reason
        return None, None

    assert run((" three",), {}) == (FinishReason.STOP, " three")
    assert run((), {2: FinishReason.STOP}, stop_ids=(ids[2],)) == (FinishReason.STOP, ids[2])
    assert run((), {2: FinishReason.STOP}) == (FinishReason.STOP, None)  # EOS
    assert run((), {1: FinishReason.LENGTH}) == (FinishReason.LENGTH, None)
