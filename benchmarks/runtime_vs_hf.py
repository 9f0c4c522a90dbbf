"""The stage runtime against HF transformers on one GPU, same random weights, same inputs.

Checks logits (prefill and teacher-forced decode) and times decode steps at several batch
sizes beside HF's forward loop (DynamicCache), plus the card's roofline measured in the
same run; `*_host_ms` is how long the host takes to queue one step (no wait on the GPU
inside it). Usage (on the GPU machine):

    python -m benchmarks.runtime_vs_hf --shape llama3-8b --out results.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import git_revision, print_table, write_json
from benchmarks.shapes import SHAPES
from foundation.model_config import ModelConfig
from kernels import paged_attention
from kernels.platform import PLATFORM
from stage_worker.config import KV_CACHE_DTYPES
from stage_worker.partition import LayerRange
from stage_worker.runner import StageRunner, StageRunnerConfig
from stage_worker.step_input import SeqChunk


def cuda_time_ms(fn: Callable[[], object], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def host_ms(fn: Callable[[], object], reps: int) -> list[float]:
    """Wall time of `fn` on the host alone (the GPU idle at the start, awaited after): how
    long the host takes to queue a step. Below the step's GPU time, the host keeps ahead of
    the card (nothing in the step waits on it)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return times


def roofline() -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and dense bf16 matmul rate, measured now."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(cuda_time_ms(lambda: dst.copy_(src), 10))
    bw = 2 * src.numel() * 2 / (ms / 1e3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = statistics.median(cuda_time_ms(lambda: a @ b, 10))
    return {"copy_TBps": bw / 1e12, "bf16_TFLOPs": 2 * 8192**3 / (ms / 1e3) / 1e12}


def build_models(shape: str, num_blocks: int, quantization: str = "none",
                 kv_cache_dtype: str = "auto") -> tuple[Any, StageRunner, ModelConfig]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(**SHAPES[shape])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    layers = LayerRange(0, cfg.num_layers, True, True)
    runner = StageRunner(
        StageRunnerConfig(Path("."), layers, torch.bfloat16, torch.device("cuda"),
                          block_size=16, num_blocks=num_blocks, quantization=quantization,
                          kv_cache_dtype=kv_cache_dtype),
        cfg, weights=dict(hf.state_dict()),
    )
    return hf, runner, cfg


def _errors(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    diff = (got.float() - want.float())
    return {"max_abs_diff": diff.abs().max().item(),
            "rel_l2_err": (diff.norm() / want.float().norm()).item(),
            "argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}


@torch.inference_mode()
def check_logits(hf: Any, runner: StageRunner, vocab: int, prompt_len: int = 128,
                 decode_steps: int = 16, seqs: int = 4,
                 ours: str = "ours_bf16") -> dict[str, dict[str, float]]:
    """Ours (bf16) and HF (bf16) each against HF in fp32 on the same bf16 weights: the bf16
    tolerance is whatever HF's own bf16 forward shows against fp32."""
    import copy

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (seqs, prompt_len + decode_steps), generator=gen)
    blocks = -(-(prompt_len + decode_steps) // 16)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(seqs)]
    rows = slice(prompt_len - 1, prompt_len + decode_steps - 1)
    ref_bf16 = hf(ids.cuda()).logits[:, rows].float()  # [seqs, steps, V]
    hf32 = copy.deepcopy(hf).float()
    ref_fp32 = hf32(ids.cuda()).logits[:, rows].float()
    del hf32
    torch.cuda.empty_cache()
    steps = [runner.execute([SeqChunk(i, 0, prompt_len, tables[i]) for i in range(seqs)],
                            ids[:, :prompt_len].reshape(-1))]
    for k in range(decode_steps - 1):
        pos = prompt_len + k
        steps.append(runner.execute([SeqChunk(i, pos, 1, tables[i]) for i in range(seqs)],
                                    ids[:, pos]))
    got = torch.stack(steps, dim=1)  # [seqs, steps, V]
    return {f"{ours}_vs_hf_bf16": _errors(got, ref_bf16),
            f"{ours}_vs_hf_fp32": _errors(got, ref_fp32),
            "hf_bf16_vs_hf_fp32": _errors(ref_bf16, ref_fp32)}


# Steps queued back to back in the pipelined measure (see `ours_decode_ms`).
BURST = 10


@torch.inference_mode()
def ours_decode_ms(runner: StageRunner, vocab: int, batch: int, ctx: int,
                   steps: int) -> tuple[float, float, float]:
    """(median GPU ms, median host ms to queue, pipelined ms) of a decode step over `batch`
    sequences. The first is one step alone, from an idle GPU to the step's last kernel: it
    includes the host's work before the step's first kernel (block tables, uploads), which
    the card waits for. The pipelined figure is BURST steps queued back to back, the host
    preparing each next step while the card runs the one before (as a stage does with
    run-ahead), divided by BURST: the card's own time per step while the host keeps
    ahead of it."""
    blocks = -(-(ctx + 2 * steps + 8) // 16)  # warm-up, the timed steps, the host-timed ones
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    ids = torch.randint(0, vocab, (batch, ctx))
    for start in range(0, batch, 8):  # prefill in groups to bound activation memory
        group = range(start, min(batch, start + 8))
        runner.execute([SeqChunk(i, 0, ctx, tables[i]) for i in group],
                       ids[list(group)].reshape(-1))
    pos = ctx
    nxt = torch.randint(0, vocab, (batch,))

    def step() -> None:
        nonlocal pos
        runner.execute([SeqChunk(i, pos, 1, tables[i]) for i in range(batch)], nxt)
        pos += 1

    for _ in range(3):
        step()
    gpu = statistics.median(cuda_time_ms(step, steps))
    host = statistics.median(host_ms(step, steps))

    def burst() -> None:
        nonlocal pos
        pos = ctx + 3  # the positions the single steps started at (KV rewritten in place)
        for _ in range(BURST):
            step()

    pipelined = statistics.median(cuda_time_ms(burst, 5)) / BURST
    return gpu, host, pipelined


@torch.inference_mode()
def hf_decode_ms(hf: Any, vocab: int, batch: int, ctx: int, steps: int) -> float:
    ids = torch.randint(0, vocab, (batch, ctx), device="cuda")
    out = hf(ids, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)

    def step() -> None:
        nonlocal past, nxt
        o = hf(nxt, past_key_values=past, use_cache=True)
        past, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)

    for _ in range(3):
        step()
    return statistics.median(cuda_time_ms(step, steps))


@contextlib.contextmanager
def eager(runner: StageRunner, reference_attention: bool = False) -> Iterator[None]:
    """Within: no CUDA graphs, and optionally the torch reference attention even where the
    Triton kernel would run (the same process, weights and inputs, side by side)."""
    saved, graphs = paged_attention.PLATFORM, runner.use_graphs
    runner.use_graphs = False
    if reference_attention:
        paged_attention.PLATFORM = dataclasses.replace(saved, use_triton=False)
    try:
        yield
    finally:
        paged_attention.PLATFORM, runner.use_graphs = saved, graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runtime_vs_hf.json"))
    ap.add_argument("--ours-only", action="store_true",
                    help="time only our decode step (graphs), no HF timing or logit checks "
                         "(the per-token floor a mesh run is compared with)")
    ap.add_argument("--quantization", default="none", choices=("none", "fp8"),
                    help="our runner's projections in e4m3 (kernels.fp8_linear); with "
                         "--ours-only the logits are also checked against HF's")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="our runner's KV pool (fp8: e4m3); with --ours-only the logits are "
                         "also checked against HF's")
    ap.add_argument("--prefill", default="8x512,1x4096",
                    help="with --ours-only: prefill steps to time, SEQSxTOKENS,... "
                         "(reported against the matmul rate, linear layers' FLOPs)")
    ap.add_argument("--blas", default="default", choices=("default", "cublas", "cublaslt"),
                    help="torch's BLAS backend for the cuBLAS matmuls (before the graphs are "
                         "captured)")
    args = ap.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    batches = [int(b) for b in args.batches.split(",")]
    config = {"shape": args.shape, "dtype": "bfloat16", "stages": 1, "tp": 1,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "context": args.ctx, "blas": args.blas,
              "kernels": ("Triton paged attention, CUDA graphs for decode; torch reference "
                          "for the rest" if PLATFORM.use_triton else
                          "torch reference (no Triton, no CUDA graphs)"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "revision": git_revision()}
    print(config)
    t0 = time.monotonic()
    roof = roofline()
    print(f"roofline: {roof}")
    # Every decode case's sequences at once (the logit check needs far fewer blocks).
    per_seq = -(-(args.ctx + 2 * args.steps + 8) // 16)
    hf, runner, cfg = build_models(args.shape, num_blocks=max(64 * 48, max(batches) * per_seq),
                                   quantization=args.quantization,
                                   kv_cache_dtype=args.kv_cache_dtype)
    print(f"models built in {time.monotonic() - t0:.0f}s")
    if args.ours_only:
        ours_only(args, config, roof, hf, runner, cfg)
        return
    logits = check_logits(hf, runner, cfg.vocab_size)
    print(f"logits vs HF (bf16): {logits}")
    if PLATFORM.use_triton:
        with eager(runner, reference_attention=True):
            ref_logits = check_logits(hf, runner, cfg.vocab_size)
        print(f"logits vs HF with the torch reference attention: {ref_logits}")
        logits["reference_attention"] = ref_logits  # type: ignore[assignment]
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    rows = []
    for b in batches:
        kv_bytes = b * args.ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        floor_ms = (weight_bytes + kv_bytes) / (roof["copy_TBps"] * 1e12) * 1e3
        ours, ours_host, pipelined = ours_decode_ms(runner, cfg.vocab_size, b, args.ctx,
                                                    args.steps)
        with eager(runner):
            ours_eager, eager_host, _ = ours_decode_ms(runner, cfg.vocab_size, b, args.ctx,
                                                       args.steps)
        with eager(runner, reference_attention=True):
            ours_ref, _, _ = ours_decode_ms(runner, cfg.vocab_size, b, args.ctx, args.steps)
        theirs = hf_decode_ms(hf, cfg.vocab_size, b, args.ctx, args.steps)
        rows.append({"batch": b, "ours_ms": ours, "ours_host_ms": ours_host,
                     "ours_pipelined_ms": pipelined, "ours_eager_ms": ours_eager,
                     "ours_eager_host_ms": eager_host,
                     "ours_eager_reference_attention_ms": ours_ref,
                     "hf_forward_loop_ms": theirs, "speedup_vs_hf": theirs / ours,
                     "roofline_ms": floor_ms,
                     "kernel_floor_ms": decode_floor_ms(hf, b, kv_bytes, roof)
                     if args.quantization == "none" else None,
                     "ours_tok_s": b / ours * 1e3})
        torch.cuda.empty_cache()
    write_json(args.out, {**config, "roofline": roof, "logits_vs_hf": logits}, rows)
    print_table(rows)


@torch.inference_mode()
def ours_prefill_ms(runner: StageRunner, vocab: int, seqs: int, length: int,
                    steps: int) -> float:
    """Median GPU ms of one step that prefills `seqs` fresh prompts of `length` tokens."""
    blocks = -(-length // 16)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(seqs)]
    ids = torch.randint(0, vocab, (seqs * length,))

    def step() -> None:
        runner.execute([SeqChunk(i, 0, length, tables[i]) for i in range(seqs)], ids)

    for _ in range(2):
        step()
    return statistics.median(cuda_time_ms(step, steps))


def linear_flops_per_token(hf: Any) -> float:
    """2 x the parameters of every linear layer (the embedding table excluded; the LM head
    counts once, as `execute` computes logits only for each sequence's last token, which
    the prefill figure then over-counts slightly in our disfavour)."""
    return 2.0 * sum(m.weight.numel() for name, m in hf.named_modules()
                     if isinstance(m, torch.nn.Linear) and name != "lm_head")


def decode_floor_ms(hf: Any, batch: int, kv_bytes: float, roof: dict[str, float]) -> float:
    """The bf16 decode step's floor at the rates measured now, kernel by kernel: each linear
    layer (the LM head included: every row samples) at the slower of streaming its weight
    and its `batch`-row GEMM at the bf16 matmul rate, plus the KV read at the copy rate.
    The residual adds, norms, rope and SiLU-and-mul are left out (about 0.3 ms at batch 256
    on an H200, far less at small batches). `roofline_ms` counts bytes only, which at large
    batches is below this: the projections become bound by FLOPs."""
    bandwidth, rate = roof["copy_TBps"] * 1e12, roof["bf16_TFLOPs"] * 1e12
    linear = sum(max(2 * m.weight.numel() / bandwidth, 2.0 * batch * m.weight.numel() / rate)
                 for m in hf.modules() if isinstance(m, torch.nn.Linear))
    return (linear + kv_bytes / bandwidth) * 1e3


def ours_only(args: argparse.Namespace, config: dict[str, Any], roof: dict[str, float],
              hf: Any, runner: StageRunner, cfg: ModelConfig) -> None:
    # What the runner streams per decode step (e4m3 projections with --quantization fp8,
    # e4m3 K/V with --kv-cache-dtype fp8).
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_elem = runner.kv.cache.element_size()
    if args.quantization != "none" or args.kv_cache_dtype != "auto":
        label = "_".join([*([args.quantization] if args.quantization != "none" else []),
                          *(["kvfp8"] if args.kv_cache_dtype != "auto" else [])])
        config = {**config, "logits_vs_hf": check_logits(hf, runner, cfg.vocab_size,
                                                         ours=f"ours_{label}")}
        print(f"logits vs HF: {config['logits_vs_hf']}")
    rows: list[dict[str, Any]] = []
    flops = linear_flops_per_token(hf)
    for seqs, length in ((int(a), int(b)) for a, b in
                         (case.split("x") for case in args.prefill.split(",") if case)):
        ms = ours_prefill_ms(runner, cfg.vocab_size, seqs, length, max(3, args.steps // 4))
        tokens = seqs * length
        rows.append({"prefill": f"{seqs}x{length}", "ours_ms": ms,
                     "ours_tok_s": tokens / ms * 1e3,
                     "linear_TFLOPs": flops * tokens / (ms / 1e3) / 1e12,
                     "of_matmul_rate": flops * tokens / (ms / 1e3) / 1e12
                     / roof["bf16_TFLOPs"]})
    for b in (int(x) for x in args.batches.split(",")):
        kv_bytes = b * args.ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_elem
        ours, ours_host, pipelined = ours_decode_ms(runner, cfg.vocab_size, b, args.ctx,
                                                    args.steps)
        # e4m3 GEMMs run at a rate this run does not measure: no kernel floor for them
        floor = decode_floor_ms(hf, b, kv_bytes, roof) if args.quantization == "none" else None
        rows.append({"batch": b, "ours_ms": ours, "ours_host_ms": ours_host,
                     "ours_pipelined_ms": pipelined,
                     "roofline_ms": (weight_bytes + kv_bytes) / (roof["copy_TBps"] * 1e12) * 1e3,
                     "kernel_floor_ms": floor, "ours_tok_s": b / ours * 1e3})
    write_json(args.out, {**config, "roofline": roof, "ours_only": True}, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
