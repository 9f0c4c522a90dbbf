"""Logit biases and min_tokens in the last stage's sampler: applied after the raw log
probabilities, before greedy and random picks, only where a row asks for them."""

from __future__ import annotations

import torch

from foundation.sampling_params import SamplingParams, SamplingParamsError
from stage_worker.sampling import Sampler, SamplingBatch

V = 50


def _sample(logits: torch.Tensor, params: list[SamplingParams], outputs: list[int]
            ) -> tuple[list[int], SamplingBatch, torch.Tensor | None]:
    batch = SamplingBatch.build(params, [()] * len(params), [()] * len(params), outputs, V)
    out = Sampler()(logits, batch)
    return out.token_ids.tolist(), batch, out.logprobs


def test_a_bias_moves_the_greedy_pick_and_leaves_logprobs_raw() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    low = logits.argmin(-1).tolist()
    params = [SamplingParams(temperature=0, logprobs=0, logit_bias=((low[0], 100.0),)),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=0, logprobs=0, logit_bias=((best[2], -100.0),))]
    ids, _, logprobs = _sample(logits, params, [0, 0, 0])
    second = logits[2].topk(2).indices[1].item()
    assert ids == [low[0], best[1], second]
    assert logprobs is not None  # the model's, not the biased distribution's
    raw = logits.log_softmax(-1)
    assert torch.equal(logprobs, raw[torch.arange(3), torch.tensor(ids)])


def test_min_tokens_bans_the_stop_ids_until_enough_outputs() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    eos = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, min_tokens=3, banned_until_min=(eos[0], 7)),
              SamplingParams(temperature=0.8, seed=5, min_tokens=3, banned_until_min=(eos[1],))]
    early, batch, _ = _sample(logits, params, [2, 2])  # the third output: still banned
    assert batch.adjust is not None and eos[0] not in early[:1] and early[1] != eos[1]
    late, batch, _ = _sample(logits, params, [3, 3])
    assert batch.adjust is None and late[0] == eos[0]


def test_no_adjustment_without_a_bias_or_a_pending_min() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, min_tokens=2)]
    batch = SamplingBatch.build(params, [(), ()], [(), ()], [0, 5], V)
    assert batch.adjust is None  # the second already has its minimum


def test_bias_limits_name_the_field() -> None:
    for bad in (((V, 1.0),), ((1, 101.0),), ((1, float("nan")),),
                tuple((i, 1.0) for i in range(301))):
        try:
            SamplingParams(logit_bias=bad).validate(V if len(bad) < 300 else 1000, 5)
        except SamplingParamsError as e:
            assert e.field == "logit_bias"
        else:
            raise AssertionError(f"accepted {bad[:2]}")
