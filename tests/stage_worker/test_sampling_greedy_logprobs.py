"""Greedy rows, logprobs and input checks of the batched sampler."""

from __future__ import annotations

import pytest
import torch

from foundation.sampling_params import SamplingParams
from stage_worker.sampling import Sampler, SamplingBatch
from tests.stage_worker.sampling_refs import build, random_logits

# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_fast_path_skips_logprobs() -> None:
    logits = random_logits(3, (16, 100)).to(torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 16, 100))
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.ranks is None
    assert out.top_token_ids.shape == (16, 0) and out.top_logprobs.shape == (16, 0)


def test_greedy_takes_argmax_of_penalised_logits() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, -1.0], [5.0, 4.0, 1.0, -1.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0, top_k=1)] * 2
    batch = build(params, 4, outputs=[[0], [2]], output_indices=[1, 1])
    # Row 0: token 0 drops to 3.0 < 4.0; row 1: penalising token 2 changes nothing.
    assert Sampler()(logits, batch).token_ids.tolist() == [1, 0]


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = random_logits(4, (32, 50), scale=0.5)  # flat: random rows rarely hit argmax
    # Unseeded random rows make the batched noise cover the greedy rows too.
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.0) for r in range(32)]
    torch.manual_seed(0)
    tokens = Sampler()(logits, build(params, 50)).token_ids
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))
    assert not torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))




# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_ids_sorted() -> None:
    vocab = 64
    logits = random_logits(11, (5, vocab))
    params = [
        SamplingParams(logprobs=None, temperature=0.0),
        SamplingParams(logprobs=0, temperature=0.5, top_k=3),
        SamplingParams(logprobs=3, repetition_penalty=2.0, seed=1),
        SamplingParams(logprobs=5, temperature=0.0, frequency_penalty=2.0),
        SamplingParams(logprobs=2, min_p=0.1),
    ]
    outputs = [[1, 2], [3], [4, 4], [int(logits[3].argmax())] * 3, []]  # row 3: -6
    batch = build(params, vocab, [[0]] * 5, outputs, [len(o) for o in outputs])
    out = Sampler()(logits, batch)
    raw = torch.log_softmax(logits.double(), dim=-1)  # float64 reference
    assert out.logprobs is not None and out.ranks is not None
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    for r in range(5):
        token = int(out.token_ids[r])
        assert out.logprobs[r].item() == pytest.approx(raw[r, token].item(), abs=1e-5)
        assert int(out.ranks[r]) == 1 + int((raw[r] > raw[r, token]).sum())
    assert out.top_token_ids.shape == (5, 5)  # K = largest request in the batch
    expected_ids = raw.argsort(dim=-1, descending=True)[:, :5]
    assert torch.equal(out.top_token_ids, expected_ids)
    torch.testing.assert_close(out.top_logprobs.double(), raw.gather(1, expected_ids))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert int(out.token_ids[3]) != int(logits[3].argmax())  # penalised, yet raw logprob


def test_logprobs_zero_gives_sampled_logprob_and_empty_top() -> None:
    logits = random_logits(12, (3, 10))
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=0)] * 3, 10))
    assert out.top_token_ids.shape == (3, 0) and out.top_logprobs.shape == (3, 0)
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).amax(dim=-1))


def test_mismatched_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="expected 2 prompts"):
        SamplingBatch.build([SamplingParams()] * 2, [[]], [[], []], [0, 0], 10)
    with pytest.raises(ValueError, match=r"logits must be \[2, V\]"):
        Sampler()(torch.zeros(3, 10), build([SamplingParams()] * 2, 10))
