"""Stop strings on streamed text.

`StopChecker` sits after the detokenizer: it receives text deltas and passes on only text that
can no longer become part of a stop string. The output is cut at the first point where the
text contains a stop string; that string and everything after it are left out (or the string
is kept, with `include_in_output`). The result does not depend on how the text was split
into deltas.

Stop token ids and EOS are not handled here: the caller checks each sampled token id first,
and a stop token ends the sequence without being detokenized (its text is never output).
At a finish that is not a stop string (a stop token, EOS, max_tokens), the caller passes the
detokenizer's `flush()` through `process` and then emits `StopChecker.flush()`:

    text, stopped = checker.process(detok.flush())
    if not stopped:
        text += checker.flush()
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Finds the first stop string in a stream of text deltas.

    Which stop string wins: the one that ends first in the text; if several end at the same
    point, the longest (it starts first). So with stop ("ab", "abc") the text "abcd" stops
    at "ab", and with ("bc", "abc") it stops at "abc".

    Args:
        stop: the stop strings, each non-empty.
        include_in_output: emit the matched stop string itself (nothing after it).

    Raises:
        ValueError: for an empty stop string (validation refuses them first).
    """

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._include = include_in_output
        # Every proper prefix of a stop string: a held suffix must be one of these.
        self._prefixes = frozenset(s[:i] for s in self._stop for i in range(1, len(s)))
        self._max_held = max((len(s) - 1 for s in self._stop), default=0)
        self._held = ""  # text that may be the start of a stop string
        self._stopped = False
        self.matched: str | None = None  # the stop string that ended the output

    @property
    def stopped(self) -> bool:
        return self._stopped

    def process(self, delta: str) -> tuple[str, bool]:
        """Take the next text delta; return (text that is now final, whether a stop string
        was found). After a stop, every call returns ("", True)."""
        if self._stopped:
            return "", True
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self._stopped, self.matched, self._held = True, stop, ""
            return text[:start + len(stop)] if self._include else text[:start], True
        keep = self._held_suffix_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """At a finish that is not a stop string: release the held text."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first, longest on a tie. The held
        part holds no whole match (it was checked before), so any match ends in the delta."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        return None if best is None else (best[0] + best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string: any
        later match must start inside it (a match starting earlier would already be whole)."""
        for n in range(min(self._max_held, len(text)), 0, -1):
            if text[len(text) - n:] in self._prefixes:
                return n
        return 0
