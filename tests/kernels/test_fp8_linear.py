"""FP8 linear layers: the per-channel weight quantization, the torch references (the CPU
path), the Triton weight-streaming kernel against the reference in Triton's interpreter and
on the GPU, the GPU's row quantization and its `torch._scaled_mm` path against theirs, and
the default model's greedy tokens and log probabilities with fp8 weights against fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.fp8_linear import (
    FP8,
    FP8_MAX,
    fp8_linear,
    fp8_linear_ref,
    fp8_linear_w8a8_ref,
    quantize_rows_ref,
    quantize_weight,
)
from tests.kernels.interpreter import run_interpreted

# (rows, out, in): a decode row, odd sizes (masked tiles), a full skinny tile.
SMALL = ((1, 64, 512), (5, 96, 300), (16, 40, 256))
# llama3-8b's projections at TP 1: qkv, o, gate_up, down.
LLAMA = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def test_weights_quantize_per_output_feature() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 9)[:, None]
    w[3] = 0.0
    q, scale = quantize_weight(w)
    assert q.dtype == FP8 and scale.shape == (8,) and scale.dtype == torch.float32
    back = q.float() * scale[:, None]
    assert torch.equal(back[3], torch.zeros(64))  # a zero row stays zero
    rows = [i for i in range(8) if i != 3]
    # each row's largest magnitude maps to e4m3's largest; the rest round to 3 mantissa bits
    assert torch.equal(q.float()[rows].abs().amax(dim=1), torch.full((7,), FP8_MAX))
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale[:, None] * 2**-9).all()


def test_cpu_tensors_take_the_reference() -> None:
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(24, 32, generator=g), torch.randn(3, 32, generator=g), torch.randn(24)
    q, scale = quantize_weight(w)
    assert torch.equal(fp8_linear(x, q, scale, b), fp8_linear_ref(x, q, scale, b))
    want = x.double() @ (q.double() * scale.double()[:, None]).T + b.double()
    assert torch.allclose(fp8_linear_ref(x, q, scale, b).double(), want, atol=1e-5)
    xq, xs = quantize_rows_ref(x)  # the W8A8 path quantizes the rows the same way
    w8a8 = (xq.double() * xs.double()[:, None]) @ (q.double() * scale.double()[:, None]).T
    assert torch.allclose(fp8_linear_w8a8_ref(x, q, scale, b).double(), w8a8 + b.double(),
                          atol=1e-5)


def check_skinny(device: str, shapes: tuple[tuple[int, int, int], ...],
                 dtypes: tuple[torch.dtype, ...]) -> None:
    """The weight-streaming kernel against the reference: its products are exact (tf32
    holds e4m3 and bf16/fp16 values), so only the fp32 sums' order and the output's rounding
    differ."""
    from kernels.skinny_linear_triton import SkinnyLaunch, skinny_linear_triton

    # The launch picked by shape, and K split over 2 and 4 programs (partial sums added by a
    # second kernel), with tiles that do and do not divide K.
    launches = (None, SkinnyLaunch(split_k=2), SkinnyLaunch(block_n=64, block_k=128, split_k=4))
    g = torch.Generator().manual_seed(2)
    for dtype in dtypes:
        for m, n, k in shapes:
            q, scale = quantize_weight(torch.randn(n, k, generator=g))
            x = torch.randn(m, k, generator=g).to(dtype)
            ref = fp8_linear_ref(x, q, scale)
            tol = (8e-3 if dtype == torch.bfloat16 else 1e-3) * ref.float().abs().max().item()
            for launch in launches:
                got = skinny_linear_triton(x.to(device), q.to(device), scale.to(device),
                                           launch=launch).cpu()
                assert got.dtype == dtype and got.shape == (m, n)
                gap = (got.float() - ref.float()).abs().max().item()
                assert gap <= tol, f"{dtype} {m}x{n}x{k} {launch}: {gap} > {tol}"


def test_skinny_kernel_in_the_interpreter() -> None:
    run_interpreted("import torch\n"
                    "from tests.kernels.test_fp8_linear import SMALL, check_skinny\n"
                    "check_skinny('cpu', SMALL, (torch.bfloat16, torch.float16))\n")


@pytest.mark.gpu
def test_skinny_kernel_on_cuda() -> None:
    shapes = SMALL + tuple((m, n, k) for m in (1, 16, 64) for n, k in LLAMA)
    check_skinny("cuda", shapes, (torch.bfloat16, torch.float16))


@pytest.mark.gpu
def test_row_quantization_and_scaled_mm_on_cuda() -> None:
    from kernels.fp8_linear_triton import quantize_rows_triton

    g = torch.Generator().manual_seed(3)
    for m, (n, k) in ((17, LLAMA[0]), (256, LLAMA[2]), (300, (960, 576))):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        x[1] = 0.0
        xq, xs = quantize_rows_triton(x.cuda())
        rq, rs = quantize_rows_ref(x)
        assert torch.equal(xs.cpu(), rs) and torch.equal(xq.cpu().float(), rq.float())
        q, scale = quantize_weight(torch.randn(n, k, generator=g))
        b = torch.randn(n, generator=g).to(torch.bfloat16)
        got = fp8_linear(x.cuda(), q.cuda(), scale.cuda(), b.cuda()).cpu()
        ref = fp8_linear_w8a8_ref(x, q, scale, b)
        tol = 8e-3 * ref.float().abs().max().item()
        assert (got.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.gpu
def test_both_paths_replay_in_a_cuda_graph() -> None:
    q, scale = quantize_weight(torch.randn(4096, 4096, device="cuda"))
    for m in (1, 64):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        want = fp8_linear(x, q, scale)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_linear(x, q, scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_a_stage_with_fp8_weights_stores_them_and_stays_close(tmp_path: Path) -> None:
    """`quantization="fp8"`: every decoder projection holds e4m3 weights with a scale per
    output feature (the embedding and LM head keep fp32); the logits stay near fp32's."""
    from stage_worker.layers.linear import LinearLayer
    from stage_worker.offline import LocalPipeline, LocalPipelineConfig
    from stage_worker.step_input import SeqChunk
    from tests.stage_worker.tiny_checkpoints import write_tiny_checkpoint

    write_tiny_checkpoint("qwen2_qkv_bias", tmp_path)
    ids = torch.randint(0, 160, (24,), generator=torch.Generator().manual_seed(4))
    logits = {}
    for quantization in ("none", "fp8"):
        pipe = LocalPipeline(LocalPipelineConfig(tmp_path, 2, block_size=8, num_blocks=8,
                                                 quantization=quantization))
        layers = [m for s in pipe.stages for m in s.model.modules()
                  if isinstance(m, LinearLayer)]
        assert layers and all((m.weight.dtype == FP8) == (quantization == "fp8")
                              and (m.fp8_scale is not None) == (quantization == "fp8")
                              for m in layers)
        assert pipe.stages[-1].model.lm_head.weight.dtype == torch.float32  # type: ignore[union-attr]
        logits[quantization] = pipe.step([SeqChunk(0, 0, 24, [0, 1, 2])], ids)
    rel = ((logits["fp8"] - logits["none"]).norm() / logits["none"].norm()).item()
    assert 0 < rel < 0.1, rel

