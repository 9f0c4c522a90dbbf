"""Prompt log probabilities through a real two-stage mesh on the default model (fp32, CPU),
against HF transformers' own log-softmax of the same prompt: every prompt token after the
first, its top alternatives, prompts split into several prefill chunks, a prompt the prefix
cache already holds, and requests that asked for none beside them in one step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from router.client import Chunk, RouterClient
from tests.default_model import chat_prompts, default_model_dir, hf_model
from tests.router.inprocess import in_process_mesh, stage_configs
from tests.router.test_engine_inprocess import wait_idle

pytestmark = pytest.mark.slow

CHUNK = 16  # tokens per step: the prompts (30-40 tokens) take several prefill chunks
TOP = 3


def hf_prompt_logprobs(prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i is the log-softmax that scores prompt token i + 1."""
    with torch.no_grad():
        logits = hf_model()(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


def check_against_hf(prompt: list[int], got: tuple) -> None:
    want = hf_prompt_logprobs(prompt)
    assert len(got) == len(prompt) - 1
    for i, (token, logprob, top) in enumerate(got):
        assert token == prompt[i + 1]
        assert logprob == pytest.approx(want[i, token].item(), abs=2e-4)
        values = want[i].topk(TOP).values
        # The same alternatives in the same order (their values agree even where two are
        # near-tied, so a swapped pair would still be caught by the values below).
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=2e-4)
        for (alt, _), hf_value in zip(top, values.tolist(), strict=True):
            assert want[i, alt].item() == pytest.approx(hf_value, abs=2e-4)


async def first_and_rest(client: RouterClient, **kwargs: object) -> tuple[Chunk, list[Chunk]]:
    chunks = [c async for c in client.generate(**kwargs)]  # type: ignore[arg-type]
    return chunks[0], chunks[1:]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


def test_prompt_logprobs_match_hf_across_chunks_and_cache(model_dir: Path) -> None:
    prompts = chat_prompts()[:3]

    async def run() -> None:
        stages = stage_configs(model_dir, 2, max_num_batched_tokens=CHUNK, max_num_seqs=8,
                               num_blocks=256)
        async with in_process_mesh(stages, max_num_batched_tokens=CHUNK, max_num_seqs=8) as mesh, \
                mesh.client() as client:
            # Two asking, one not, in the same steps.
            (a, _), (b, _), (plain, _) = await asyncio.gather(
                first_and_rest(client, token_ids=prompts[0], max_tokens=2, temperature=0.0,
                               prompt_logprobs=TOP),
                first_and_rest(client, token_ids=prompts[1], max_tokens=2, temperature=0.0,
                               prompt_logprobs=0, n=2),
                first_and_rest(client, token_ids=prompts[2], max_tokens=2, temperature=0.0))
            check_against_hf(prompts[0], a.prompt_logprobs)
            assert a.prompt_tokens == len(prompts[0])
            assert [len(top) for _, _, top in b.prompt_logprobs] == [0] * (len(prompts[1]) - 1)
            want = hf_prompt_logprobs(prompts[1])
            assert [lp for _, lp, _ in b.prompt_logprobs] == pytest.approx(
                [want[i, t].item() for i, t in enumerate(prompts[1][1:])], abs=2e-4)
            assert plain.prompt_logprobs == ()
            # The same prompt again: its blocks are in the prefix cache, but a request that
            # asks for prompt logprobs computes every position (and reports no cached tokens).
            out = await client.complete(token_ids=prompts[0], max_tokens=1, temperature=0.0)
            assert out.usage is not None and out.usage["cached_prompt_tokens"] > 0
            first, rest = await first_and_rest(client, token_ids=prompts[0], max_tokens=1,
                                               temperature=0.0, prompt_logprobs=TOP)
            usage = next(c.usage for c in rest if c.usage is not None)
            assert usage["cached_prompt_tokens"] == 0
            assert [t for t, _, _ in first.prompt_logprobs] == [t for t, _, _ in a.prompt_logprobs]
            assert [lp for _, lp, _ in first.prompt_logprobs] == pytest.approx(
                [lp for _, lp, _ in a.prompt_logprobs], abs=2e-4)
            # Out of range: INVALID_ARGUMENT naming the field and the limit.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.complete(token_ids=prompts[0], max_tokens=1, prompt_logprobs=21)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt_logprobs" in (err.value.details() or "")
            assert "20" in (err.value.details() or "")
            await wait_idle(client, mesh.stage_sequences)

    asyncio.run(run())
