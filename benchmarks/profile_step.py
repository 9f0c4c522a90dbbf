"""Where one stage step's GPU time goes, op by op, against each op's own floor.

Builds one stage holding every layer of a model shape (random bf16 weights, as
`runtime_vs_hf`), then profiles eager decode steps at several batch sizes and one long
prefill chunk with torch.profiler. Each module of a layer runs inside a profiler range (a
forward hook), so kernels are attributed to what launched them: the norms, the four
projections, the attention core (rope, KV write, paged attention), the activation, the
residual adds, and the final norm with the LM head. Each part's time per step is set
against its floor on this card, measured in the same run: bytes it must move over the copy
rate, or FLOPs over the bf16 matmul rate, whichever is larger. The decode step with CUDA
graphs (what serving runs) is timed beside the eager one.

    python -m benchmarks.profile_step --shape llama3-8b --batches 1,64,256 --ctx 512 \\
        --prefill 4096 --out profile_step.json
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.report import git_revision, print_table, write_json
from benchmarks.runtime_vs_hf import build_models, cuda_time_ms, eager, roofline
from foundation.model_config import ModelConfig
from stage_worker.runner import StageRunner
from stage_worker.step_input import SeqChunk

BLOCK = 16
# Module attribute name -> the part it is reported as (leaf modules of a decoder layer).
PARTS = {"input_layernorm": "norms", "post_attention_layernorm": "norms",
         "qkv_proj": "qkv_proj", "o_proj": "o_proj", "gate_up_proj": "gate_up_proj",
         "down_proj": "down_proj"}


# Triton kernels (attached to no profiler range) by part: the kernel's name contains one.
TRITON_KERNELS = {"triton_attention": ("paged_attention", "_merge_splits", "_rope_kv"),
                  "triton_norm": ("_rms_norm_kernel",), "triton_silu": ("_silu_and_mul_kernel",)}


@dataclass(frozen=True)
class Case:
    """One profiled step: `seqs` sequences, each computing `new` tokens after `ctx`."""

    name: str
    seqs: int
    ctx: int
    new: int

    @property
    def tokens(self) -> int:
        return self.seqs * self.new


def label_modules(model: nn.Module) -> None:
    """Wrap every decoder layer's leaf modules, its attention, MLP and the layer itself, the
    final norm and the LM head in profiler ranges named `part:<name>`."""
    def wrap(module: nn.Module, label: str) -> None:
        def pre(_m: nn.Module, _args: Any) -> None:
            ctx = torch.profiler.record_function(label)
            ctx.__enter__()
            stack.append(ctx)

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            stack.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    stack: list[Any] = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in PARTS:
            wrap(module, f"part:{PARTS[leaf]}")
        elif leaf in ("self_attn", "mlp"):
            wrap(module, f"part:{leaf}")
        elif name.startswith("model.layers.") and name.count(".") == 2:
            wrap(module, "part:layer")
        elif name in ("model.norm", "lm_head"):
            wrap(module, "part:head")


def device_ms_by_label(prof: torch.profiler.profile, steps: int) -> dict[str, float]:
    """Device time per step of every `part:` range (kernels launched inside it), and of all
    kernels together under `total`."""
    out: dict[str, float] = {}
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = prof.events()
    for evt in events:  # the host-side ranges: device time = the kernels launched inside
        if evt.device_type == cpu and evt.name.startswith("part:"):
            key = evt.name[5:]
            out[key] = out.get(key, 0.0) + evt.device_time_total / 1e3 / steps
    kernels = [e for e in events if e.device_type == cuda and not e.name.startswith("part:")]
    out["total"] = sum(e.device_time_total for e in kernels) / 1e3 / steps
    # A Triton launch is not an aten op: the profiler attaches its kernel to no range, so
    # Triton kernels are found by name (`parts_of` moves them into their parts).
    for key, names in TRITON_KERNELS.items():
        out[key] = sum(e.device_time_total for e in kernels
                       if any(name in e.name for name in names)) / 1e3 / steps
    return out


def parts_of(ms: dict[str, float]) -> dict[str, float]:
    """Disjoint parts: the attention core and the activation are what their module spent
    beyond its projections; residual adds and the rest are what the layer spent beyond
    its modules; `other` is the step's kernels outside every layer and the head
    (embedding, rope tables, KV slots, the decode rows' gathers). Triton kernels, attached
    to no range, count in their parts by name (`TRITON_KERNELS`; the final norm's kernel
    counts in `norms`)."""
    get = ms.get
    attn_core = (get("self_attn", 0) - get("qkv_proj", 0) - get("o_proj", 0)
                 + get("triton_attention", 0))
    act = get("mlp", 0) - get("gate_up_proj", 0) - get("down_proj", 0) + get("triton_silu", 0)
    residual = get("layer", 0) - get("self_attn", 0) - get("mlp", 0) - get("norms", 0)
    other = (get("total", 0) - get("layer", 0) - get("head", 0)
             - sum(get(key, 0) for key in TRITON_KERNELS))
    return {"norms": get("norms", 0) + get("triton_norm", 0), "qkv_proj": get("qkv_proj", 0),
            "attention core": attn_core, "o_proj": get("o_proj", 0),
            "gate_up_proj": get("gate_up_proj", 0), "silu_and_mul": act,
            "down_proj": get("down_proj", 0), "residual adds": residual,
            "final norm + lm_head": get("head", 0), "other": other}


def floors_ms(cfg: ModelConfig, case: Case, roof: dict[str, float]) -> dict[str, float]:
    """Each part's floor: max(bytes / copy rate, FLOPs / matmul rate), all layers; bf16."""
    bw, flops = roof["copy_TBps"] * 1e12, roof["bf16_TFLOPs"] * 1e12
    t, h, n_layers = case.tokens, cfg.hidden_size, cfg.num_layers
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def gemm(k: int, n: int, rows: int = t, layers: int = n_layers) -> float:
        moved = 2 * (k * n + rows * k + rows * n)
        return layers * max(moved / bw, 2 * rows * k * n / flops) * 1e3

    def stream(elems: float) -> float:  # elementwise: bf16 in and out
        return n_layers * 2 * elems / bw * 1e3

    # Attention: every sequence reads its K and V so far; prefill also does the causal
    # QK^T and PV matmuls (half the square, plus the cached prefix).
    kv_read = 2 * case.seqs * (case.ctx + case.new) * kv_dim * 2
    attn_flops = 4 * case.seqs * case.new * (case.ctx + case.new / 2) * q_dim
    attn = n_layers * max((kv_read + 4 * t * q_dim) / bw, attn_flops / flops) * 1e3
    inter = cfg.intermediate_size
    head_rows = case.seqs  # the sampled rows only
    return {"norms": stream(2 * 2 * t * h), "qkv_proj": gemm(h, q_dim + 2 * kv_dim),
            "attention core": attn, "o_proj": gemm(q_dim, h),
            "gate_up_proj": gemm(h, 2 * inter), "silu_and_mul": stream(3 * t * inter),
            "down_proj": gemm(inter, h), "residual adds": stream(2 * 3 * t * h),
            "final norm + lm_head": gemm(h, cfg.vocab_size, head_rows, 1), "other": 0.0}


def run_case(runner: StageRunner, cfg: ModelConfig, case: Case,
             steps: int) -> tuple[dict[str, float], float | None]:
    """(device ms per part, eager), and the graph-replay step time for decodes."""
    blocks = blocks_per_seq(case, steps)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(case.seqs)]
    ids = torch.randint(0, cfg.vocab_size, (case.seqs, case.ctx + case.new))
    pos = 0
    if case.ctx:
        for start in range(0, case.seqs, 8):  # the context, in groups (bounded memory)
            group = range(start, min(case.seqs, start + 8))
            runner.execute([SeqChunk(i, 0, case.ctx, tables[i]) for i in group],
                           ids[list(group), :case.ctx].reshape(-1))
        pos = case.ctx

    def step() -> None:
        nonlocal pos
        runner.execute([SeqChunk(i, pos, case.new, tables[i]) for i in range(case.seqs)],
                       ids[:, :case.new].reshape(-1).cuda())
        if case.new == 1:
            pos += 1  # a prefill chunk is computed again at the same positions (idempotent)

    graph_ms = None
    if case.new == 1 and runner.use_graphs:
        for _ in range(3):
            step()
        graph_ms = statistics.median(cuda_time_ms(step, steps))
    with eager(runner):
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    return parts_of(device_ms_by_label(prof, steps)), graph_ms


def blocks_per_seq(case: Case, steps: int) -> int:
    """KV blocks a sequence needs: its context and chunk, and for decodes every step the
    case runs (warm-up, graph timing, profiling)."""
    extra = 2 * steps + 8 if case.new == 1 else 0
    return -(-(case.ctx + case.new + extra) // BLOCK)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=4096, help="one chunk of this many tokens")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("profile_step.json"))
    args = ap.parse_args()
    cases = [Case(f"decode b{b} ctx{args.ctx}", b, args.ctx, 1)
             for b in (int(x) for x in args.batches.split(","))]
    if args.prefill:
        cases.append(Case(f"prefill 1x{args.prefill}", 1, 0, args.prefill))
    need = max(c.seqs * blocks_per_seq(c, args.steps) for c in cases)
    roof = roofline()
    print(f"roofline: {roof}", flush=True)
    hf, runner, cfg = build_models(args.shape, num_blocks=need)
    del hf
    torch.cuda.empty_cache()
    label_modules(runner.model)
    rows: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for case in cases:
        print(f"profiling {case.name} ...", flush=True)
        parts, graph_ms = run_case(runner, cfg, case, args.steps)
        floors = floors_ms(cfg, case, roof)
        eager_ms = sum(parts.values())
        for part, ms in parts.items():
            rows.append({"case": case.name, "part": part, "ms": ms,
                         "share": ms / eager_ms if eager_ms else 0.0,
                         "floor_ms": floors[part],
                         "of_floor": floors[part] / ms if ms > 0 else 0.0})
        summary.append({"case": case.name, "eager_ms": eager_ms, "graph_ms": graph_ms,
                        "floor_ms": sum(floors.values()),
                        "of_floor": sum(floors.values()) / (graph_ms or eager_ms)})
        torch.cuda.empty_cache()
    config = {"shape": args.shape, "dtype": "bfloat16", "stages": 1, "tp": 1,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "roofline": roof, "steps": args.steps, "revision": git_revision()}
    write_json(args.out, {**config, "summary": summary}, rows)
    print_table(rows)
    print_table(summary)


if __name__ == "__main__":
    main()
