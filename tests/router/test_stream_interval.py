"""`--stream-interval`: updates carry that many tokens, and nothing but their grouping
changes. The default model computes for real (1 stage, in process); every request is run
at interval 1 and at interval 4 and compared choice by choice: text, token ids, finish
reasons and usage exactly, logprobs to fp32 rounding. At interval > 1 a choice without
stop strings holds its tokens and decodes them together when its update is due; one with
stop strings decodes each token as it comes, so it still ends exactly at the stop string."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from router.client import Chunk
from tests.default_model import default_model_dir
from tests.router.inprocess import in_process_mesh, stage_configs

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


async def _streams(interval: int, requests: list[dict[str, Any]]) -> list[list[Chunk]]:
    stages = stage_configs(default_model_dir(), 1, num_blocks=256)
    async with in_process_mesh(stages, stream_interval=interval) as mesh, \
            mesh.client() as client:
        async def one(kwargs: dict[str, Any]) -> list[Chunk]:
            return [c async for c in client.generate(**kwargs)]
        return list(await asyncio.gather(*(one(r) for r in requests)))


def _by_choice(chunks: list[Chunk]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for c in chunks:
        if c.usage is not None:
            continue
        o = out.setdefault(c.index, {"text": "", "ids": [], "logprobs": [], "finish": None})
        o["text"] += c.text
        o["ids"] += c.token_ids
        o["logprobs"] += c.logprobs
        o["finish"] = c.finish_reason or o["finish"]
    return out


def _same_logprobs(got: list[Any], want: list[Any]) -> None:
    """Same token ids, same values to fp32 rounding: the batches the sequences shared differ
    between the runs (their timing does), and so does the order of the sums."""
    assert len(got) == len(want)
    for (gid, glp, gtop), (wid, wlp, wtop) in zip(got, want, strict=True):
        assert gid == wid and [t for t, _ in gtop] == [t for t, _ in wtop]
        assert glp == pytest.approx(wlp, abs=1e-4)
        assert [v for _, v in gtop] == pytest.approx([v for _, v in wtop], abs=1e-4)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


def test_interval_groups_tokens_and_changes_nothing_else(model_dir: Path) -> None:
    greedy = {"messages": CHAT, "max_tokens": 23, "ignore_eos": True, "temperature": 0.0}
    # Find a stop string that greedy decoding reaches in the middle of its text.
    first = asyncio.run(_streams(1, [greedy]))[0]
    text = _by_choice(first)[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3 and text.index(stop) > 0
    requests = [
        greedy,
        {**greedy, "stop": [stop]},
        {"messages": CHAT, "max_tokens": 13, "n": 2, "temperature": 1.0, "seed": 7,
         "logprobs": 2},
        {"prompt": "Count: one, two,", "max_tokens": 9, "temperature": 0.0},
    ]
    every = asyncio.run(_streams(1, requests))
    grouped = asyncio.run(_streams(4, requests))
    for one, four in zip(every, grouped, strict=True):
        a, b = _by_choice(four), _by_choice(one)
        assert a.keys() == b.keys()
        for index in a:
            assert [a[index][k] for k in ("text", "ids", "finish")] == \
                [b[index][k] for k in ("text", "ids", "finish")]
            _same_logprobs(a[index]["logprobs"], b[index]["logprobs"])
        u1, u4 = one[-1].usage, four[-1].usage  # (prefix-cache hits depend on timing)
        assert u1 is not None and u4 is not None
        assert (u4["prompt_tokens"], u4["completion_tokens"]) == \
            (u1["prompt_tokens"], u1["completion_tokens"])
    # Interval 4, one choice, no stop strings: 4 tokens per update but the last (which
    # flushes at the finish). A consumer that fell behind gets updates merged, so counts are
    # multiples of 4.
    sizes = [len(c.token_ids) for c in grouped[0] if c.usage is None]
    assert sum(sizes) == 23 and sizes[-1] % 4 == 3
    assert all(n % 4 == 0 for n in sizes[:-1])
    stopped = _by_choice(grouped[1])[0]
    assert stopped["finish"] == "stop" and stopped["text"] == text[:text.index(stop)]
    # Two choices share the request's updates: 2 tokens each per update of 4.
    pair = [c for c in grouped[2] if c.usage is None and c.finish_reason is None]
    assert pair and all(len(c.token_ids) % 2 == 0 for c in pair)
