"""torch's argmax over [S, 128256] logits against the Triton row argmax, each call timed
inside a CUDA graph of 20 calls (no launch cost); µs per call."""

import torch

from kernels.argmax_triton import argmax_rows_triton


def timed_us(f, x: torch.Tensor, n: int = 200) -> float:
    for _ in range(10):
        f(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            f(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n // 20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000


for rows in (1, 16, 64, 256):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, 128256, device="cuda", dtype=dtype)
        assert torch.equal(x.argmax(-1), argmax_rows_triton(x))
        old = timed_us(lambda y: y.argmax(-1), x)
        widened = timed_us(lambda y: y.float().argmax(-1), x)
        print(rows, dtype, f"torch {old:.1f} us (fp32 of bf16 + argmax {widened:.1f})  "
              f"triton {timed_us(argmax_rows_triton, x):.1f} us")
