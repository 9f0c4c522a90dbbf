"""Activation compression on a data-plane hop: what each form sends, how close it comes back,
what a receiver refuses, and a compressed hop between two real stage leaders over TCP."""

from __future__ import annotations

import time

import pytest
import torch

from stage_worker.build import build_stage_rank
from stage_worker.config import StageConfig
from stage_worker.dataplane.compression import (
    INT8_GROUP,
    CompressedFormError,
    Compression,
    compress,
    decompress,
)
from stage_worker.leader import ActivationMismatchError, StageLeader
from stage_worker.parallel import TPGroup
from stage_worker.plan import StageNewSeq, StagePlan
from tests.default_model import default_model_dir

TOKEN = b"t" * 32


def _activations(rows: int = 5, hidden: int = 64) -> torch.Tensor:
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0)) * 4
    x[1] = 0.0  # a row of zeros
    x[2, 3] = 1e4  # an outlier in one row
    return x


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(("mode", "nbytes", "rel"), [
    (Compression.NONE, 4 * 5 * 64, 0.0),
    (Compression.BF16, 2 * 5 * 64, 2.0**-8),
    (Compression.FP16, 2 * 5 * 64, 2.0**-11),
])
def test_casts_round_trip_within_their_precision(mode: Compression, nbytes: int,
                                                 rel: float) -> None:
    x = _activations()
    sent = compress(x, mode)
    assert _nbytes(sent) == nbytes
    back = decompress(sent, (5, 64), torch.float32)
    assert back.dtype == torch.float32
    assert ((back - x).abs() <= rel * x.abs()).all()


def test_int8_is_about_a_quarter_and_errs_by_half_a_step_per_group() -> None:
    x = _activations(hidden=256)
    q, scale = compress(x, Compression.INT8)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.shape == (5, 256 // INT8_GROUP)
    assert _nbytes([q, scale]) == 5 * 256 + 4 * 5 * 4
    back = decompress([q, scale], (5, 256), torch.float32)
    groups = x.reshape(5, 4, INT8_GROUP)
    step = (groups.abs().amax(dim=-1, keepdim=True) / 127).expand_as(groups).reshape(5, 256)
    assert ((back - x).abs() <= step / 2 + 1e-6 * x.abs()).all()
    assert back[1].eq(0).all() and scale[1].eq(1.0).all()  # zeros stay zeros
    # The outlier (row 2, channel 3) costs only its own group's precision.
    assert (back[2, INT8_GROUP:] - x[2, INT8_GROUP:]).abs().max() <= (
        x[2, INT8_GROUP:].abs().max() / 254 + 1e-6)


def test_int8_of_a_width_no_group_divides_has_one_scale_per_token() -> None:
    x = _activations(hidden=100)
    q, scale = compress(x, Compression.INT8)
    assert scale.shape == (5, 1)
    back = decompress([q, scale], (5, 100), torch.float32)
    assert ((back - x).abs() <= x.abs().amax(dim=-1, keepdim=True) / 254 + 1e-6).all()


def test_sixteen_bit_activations_are_sent_as_they_are() -> None:
    x = _activations().to(torch.bfloat16)
    (sent,) = compress(x, Compression.BF16)
    assert sent is x
    assert decompress([x], (5, 64), torch.float32).dtype == torch.float32
    empty = compress(torch.empty(0, 64), Compression.INT8)
    assert decompress(empty, (0, 64), torch.float32).shape == (0, 64)


@pytest.mark.parametrize("tensors", [
    [torch.zeros(5, 64, dtype=torch.int64)],
    [torch.zeros(5, 63)],
    [torch.zeros(5, 64, dtype=torch.int8)],
    [torch.zeros(5, 64, dtype=torch.int8), torch.ones(4, 1)],
    [torch.zeros(5, 64, dtype=torch.int8), torch.ones(5)],
    [torch.zeros(5, 64, dtype=torch.int8), torch.ones(5, 3)],
    [torch.zeros(5, 64, dtype=torch.int8), torch.ones(5, 1, dtype=torch.float16)],
    [torch.zeros(5, 64), torch.zeros(5, 64)],
])
def test_other_forms_are_refused_naming_what_came(tensors: list[torch.Tensor]) -> None:
    with pytest.raises(CompressedFormError, match=r"the step needs \[5, 64\] activations"):
        decompress(tensors, (5, 64), torch.float32)


def _leader(stage_index: int, compression: Compression) -> StageLeader:
    cfg = StageConfig(default_model_dir(), stage_index=stage_index, num_stages=2)
    return StageLeader(build_stage_rank(cfg, TPGroup()), step_timeout_s=5.0,
                       compression=compression)


def _prefill(step: int, seq_id: int) -> StagePlan:
    tokens = (1, 504, 3458, 282, 4649, 30)  # "The capital of France?"-like ids
    return StagePlan(step, (StageNewSeq(seq_id, tokens, len(tokens), (seq_id,), 0, len(tokens),
                                        True, None),), (), ())


@pytest.mark.parametrize("mode", [Compression.BF16, Compression.INT8])
def test_a_compressed_hop_between_two_stages_gives_the_uncompressed_greedy_token(
        mode: Compression) -> None:
    """Two real stages of the default model over TCP: the first sends compressed, the last
    reads it into its own dtype and samples; the greedy token equals the one of an
    uncompressed hop for the same prompt (the second sequence), and a hop whose first stage
    sends nothing the plan asked for is refused."""
    first, last = _leader(0, mode), _leader(1, Compression.NONE)
    try:
        first.connect_downstream(last.listen_upstream("127.0.0.1", TOKEN, 0), TOKEN, 0)
        deadline = time.monotonic() + 5
        while not (first.linked and last.linked):
            assert time.monotonic() < deadline, "data-plane link never came up"
            time.sleep(0.01)
        first.run_step(_prefill(0, 1))
        compressed = last.run_step(_prefill(0, 1))
        # The same prompt as another sequence, sent uncompressed.
        first.compression = Compression.NONE
        first.run_step(_prefill(1, 2))
        uncompressed = last.run_step(_prefill(1, 2))
        assert compressed.token_ids == uncompressed.token_ids
        # The last stage refuses what no form of the plan's activations can be.
        first.links.send(2, [torch.zeros(3, dtype=torch.int64)])
        with pytest.raises(ActivationMismatchError, match="step 2: upstream activations do "
                                                          "not fit the plan"):
            last.run_step(_prefill(2, 3))
    finally:
        first.shutdown()
        last.shutdown()
