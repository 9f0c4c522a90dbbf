"""Pushing a stream's token ids into a detokenizer in runs, as the front does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Pushes(Protocol):
    def push_many(self, token_ids: Sequence[int]) -> str: ...


def push_runs(d: _Pushes, ids: Sequence[int], runs: Sequence[int]) -> list[str]:
    """The deltas of `ids` pushed `runs[0]`, `runs[1]`, ... at a time, until `ids` run out
    (no flush)."""
    deltas, i = [], 0
    for n in runs:
        if i >= len(ids):
            break
        deltas.append(d.push_many(ids[i:i + n]))
        i += n
    return deltas
