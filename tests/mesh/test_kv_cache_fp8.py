"""`serve --kv-cache-dtype fp8` as real processes: a stage whose pool holds e4m3 K/V gives
the greedy tokens of the same model run in one process with an fp8 pool, which are not
HF's (so the stage did store e4m3), and the KV returns to idle.

Requests go one at a time and the in-process run takes one prompt at a time: with e4m3 K/V a
different batch (other matmul blockings, fp32 sums in another order) can move a value across
an e4m3 rounding boundary, a step of 6 %, and change a greedy token; with the same shapes
the two are the same computation. Both run one CPU thread: MKL's fp32 products of some
shapes (7 or 64 rows of the default model's) differ in the last bit between one thread and
two, and one CI run gave the first question another first token (a near-tie), most likely
that way."""

from __future__ import annotations

import asyncio

import pytest
import torch

from router.client import RouterClient
from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate
from tests.default_model import EOS, QUESTIONS, chat_prompts, default_model_dir, hf_greedy
from tests.mesh.harness import Mesh, wait_idle

pytestmark = pytest.mark.slow
COUNT, TOKENS = 4, 24  # the first questions; three of them leave HF's answer by token 2


def test_greedy_tokens_equal_an_fp8_pool_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = LocalPipeline(LocalPipelineConfig(default_model_dir(), 1, num_blocks=512,
                                                 kv_cache_dtype="fp8"))
        want = [greedy_generate(pipe, [prompt], TOKENS, stop_ids=[EOS])[0]
                for prompt in chat_prompts()[:COUNT]]
    finally:
        torch.set_num_threads(threads)
    assert want != [hf[:TOKENS] for hf in hf_greedy()[:COUNT]], "e4m3 K/V change no answer"

    async def run(address: str) -> list[list[int]]:
        async with RouterClient(address) as client:
            return [(await client.complete(messages=[{"role": "user", "content": q}],
                                           temperature=0.0, max_tokens=TOKENS)).token_ids[0]
                    for q in QUESTIONS[:COUNT]]

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the stage's threads (serve keeps them)
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    with Mesh("--stages", "1", "--kv-cache-dtype", "fp8", "--num-blocks", "512") as mesh:
        assert asyncio.run(run(mesh.address)) == want
        wait_idle(mesh.stub())
