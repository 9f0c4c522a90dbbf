"""SamplingParams validation: every limit named with its field; no torch on import."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from foundation.sampling_params import SamplingParams, SamplingParamsError

# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"temperature": -0.1}, "temperature", "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, "temperature", "temperature must be a finite number >= 0"),
        ({"top_k": -2}, "top_k", "top_k must be -1 or 0 (off) or in [1, 100], got -2"),
        ({"top_k": 101}, "top_k", "top_k must be -1 or 0 (off) or in [1, 100], got 101"),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"min_p": -0.1}, "min_p", "min_p must be in [0, 1], got -0.1"),
        ({"seed": 2**64}, "seed", f"seed must be in [{-(2**63)}, {2**64 - 1}], got {2**64}"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "must be a finite number > 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "must be in [-2.0, 2.0], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty", "must be in [-2.0, 2.0], got -3"),
        ({"logprobs": 21}, "logprobs", "logprobs must be None or in [0, 20], got 21"),
        ({"logprobs": -1}, "logprobs", "logprobs must be None or in [0, 20], got -1"),
    ],
)
def test_validation_names_field_and_limit(kwargs: dict, field: str, message: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs).validate(vocab_size=100, max_logprobs=20)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert message in str(info.value) and str(info.value).startswith(field)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0, "top_k": 100, "top_p": 1e-9, "min_p": 1.0, "logprobs": 20},
        {"top_k": 0, "seed": -(2**63), "presence_penalty": -2.0, "frequency_penalty": 2.0},
    ],
)
def test_validation_accepts_the_edges(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    params.validate(vocab_size=100, max_logprobs=20)  # raises SamplingParamsError if refused
    assert all(getattr(params, name) == value for name, value in kwargs.items())


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams().is_greedy


def test_sampling_params_import_no_torch() -> None:
    code = "import sys, foundation.sampling_params; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
