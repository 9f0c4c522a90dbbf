"""The Triton row argmax against torch's (the reference): the first index of the largest value,
ties included, over vocabulary-sized and odd rows, in fp32, bf16 and fp16; on CUDA (marker
`gpu`) and on this machine through Triton's interpreter when triton is installed."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.argmax import argmax_rows, argmax_rows_ref
from tests.kernels.interpreter import run_interpreted

# (rows, vocab): a decode row of llama3's and of SmolLM2's vocabularies, a batch, odd widths
# (a last chunk shorter than the rest, fewer columns than chunks, one column).
SHAPES = ((1, 128256), (3, 49152), (64, 128256), (5, 1001), (2, 100), (4, 1))
INTERPRETED_SHAPES = ((1, 5000), (3, 1001), (4, 1))


def check(device: str, shapes: tuple[tuple[int, int], ...] = SHAPES,
          dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
          launches: tuple[tuple[int, int], ...] = ((128, 1024), (16, 64))) -> None:
    """Random rows, then the same rows with planted ties (the first must win), -inf runs
    and a +inf, each against torch's argmax, for each (max ranges, tile) launch: the
    default, and one that walks several tiles per range."""
    from kernels.argmax_triton import argmax_rows_triton

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for rows, vocab in shapes:
            x = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
            cases = {"random": x}
            tied = x.clone()
            top = tied.max().item() + 1
            for r in range(rows):  # two equal maxima, far apart (different chunks)
                a, b = sorted(torch.randint(0, vocab, (2,), generator=gen).tolist())
                tied[r, a] = tied[r, b] = top
            cases["ties"] = tied
            low = x.clone()
            low[:, : vocab // 2] = float("-inf")
            cases["-inf"] = low
            inf = x.clone()
            inf[:, vocab // 3] = float("inf")
            cases["+inf"] = inf
            cases["all -inf"] = torch.full_like(x, float("-inf"))
            for (name, case), (chunks, block) in itertools.product(cases.items(), launches):
                got = argmax_rows_triton(case.to(device), chunks, block).cpu()
                want = argmax_rows_ref(case)
                assert got.dtype == torch.int64
                assert torch.equal(got, want), \
                    f"{name} {dtype} {rows}x{vocab} {chunks}x{block}: {got} {want}"


def test_cpu_tensors_take_the_reference() -> None:
    x = torch.randn(3, 17)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.gpu
def test_the_kernel_on_cuda() -> None:
    check("cuda")


def test_the_kernel_in_the_triton_interpreter() -> None:
    run_interpreted("import torch; from tests.kernels.test_argmax import INTERPRETED_SHAPES as S, "
                    "check; check('cpu', S, (torch.float32, torch.bfloat16))")
