"""The null runner's activations: zeros of the step's shape out of the first stage, rows of
one kept buffer (a step neither allocates nor fills them), and a middle stage's inputs
passed through as they came."""

from __future__ import annotations

import torch

from stage_worker.model_runner import StageCapacity, StageShape
from stage_worker.null_runner import NullRunner
from stage_worker.partition import LayerRange

CAPACITY = StageCapacity(num_blocks=16, block_size=16, max_num_batched_tokens=64,
                         max_num_seqs=8)


def _runner(first: bool, last: bool, dtype: torch.dtype = torch.float32) -> NullRunner:
    shape = StageShape(LayerRange(0, 2, first, last), hidden_size=6, vocab_size=50,
                       dtype=dtype, device=torch.device("cpu"))
    return NullRunner(shape, CAPACITY)


def test_first_stage_zeros_have_the_step_shape_and_share_one_buffer() -> None:
    runner = _runner(first=True, last=False, dtype=torch.bfloat16)
    ids = torch.zeros(5, dtype=torch.int64)
    a = runner.execute([], ids)
    assert a.shape == (5, 6) and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert not a.any()
    b = runner.execute([], torch.zeros(3, dtype=torch.int64))
    assert b.shape == (3, 6) and b.data_ptr() == a.data_ptr()  # no new buffer
    c = runner.execute([], torch.zeros(40, dtype=torch.int64))  # grows once
    assert c.shape == (40, 6) and not c.any()
    assert runner.execute([], ids).data_ptr() == c.data_ptr()


def test_a_middle_stage_passes_its_inputs_through() -> None:
    runner = _runner(first=False, last=False)
    x = torch.randn(4, 6)
    assert runner.execute([], x) is x
