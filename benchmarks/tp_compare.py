"""One stage at TP 1 and at TP N on the same weights, through the real mesh: greedy tokens and
log probabilities of seeded prompts compared with TP 1's, and the decode step time at a few
batch sizes against TP 1's and against the roofline of N cards.

    python -m benchmarks.tp_compare --model DIR --device cuda --tp 1,2 \
        --out benchmarks/results/tp-DATE.json

Each TP size is its own `stagemesh serve --stages 1 --tp N` (on a machine with enough GPUs,
rank r of the stage runs on cuda:r and the ranks all-reduce over NCCL; on CPU, over gloo).

- Parity: `--prompts` prompts of `--prompt-len` token ids drawn with a fixed seed, greedy,
  `--max-tokens` each, `--top` log probabilities per token. A prompt is identical when its
  token ids equal TP 1's; up to its first differing token, the chosen token's log
  probability is compared (max abs difference).
- Step time: `batch` sequences of `--context` prompt tokens kept decoding (each re-submits
  when its request ends); ms per step from the router's step counter over `--window`
  seconds, and the stage's own mean step time as the router reports it.
- Roofline (CUDA): each card streams its 1/N of the weights (the embedding table is gathered,
  not streamed) and of the KV at `--context` per step, at the copy rate measured now on
  cuda:0.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import random
from pathlib import Path
from typing import Any

from benchmarks.control_plane import steady_decode
from benchmarks.report import git_revision, print_table, stage_figures, write_json
from foundation.model_config import ModelConfig
from foundation.modelstore.store import resolve_model
from router.client import RouterClient
from stagemesh.local_mesh import Mesh


def seeded_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


async def greedy(address: str, prompts: list[list[int]], max_tokens: int, top: int
                 ) -> list[dict[str, Any]]:
    """Per prompt: its greedy token ids and each token's log probability."""
    async with RouterClient(address) as client:
        async def one(prompt: list[int]) -> dict[str, Any]:
            ids: list[int] = []
            logprobs: list[float] = []
            async for chunk in client.generate(token_ids=prompt, max_tokens=max_tokens,
                                               ignore_eos=True, temperature=0.0, logprobs=top,
                                               timeout=600):
                ids += chunk.token_ids
                logprobs += [lp for _, lp, _ in chunk.logprobs]
            return {"token_ids": ids, "logprobs": logprobs}

        return list(await asyncio.gather(*(one(p) for p in prompts)))


async def decode_rate(address: str, batch: int, context: int, vocab: int, window_s: float,
                      max_tokens: int) -> dict[str, float]:
    """`batch` sequences of `context` prompt tokens decoding for `window_s`: the router's
    steps over it."""
    requests = [dict(token_ids=p, max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                     timeout=600) for p in seeded_prompts(batch, context, vocab, seed=1)]
    got = await steady_decode(address, requests, window_s, settle_s=1.0)  # past prefills
    return {"ms_per_step": 1e3 * got["seconds"] / max(got["steps"], 1), "steps": got["steps"]}


def compare(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """How `other`'s greedy runs differ from `base`'s, prompt by prompt."""
    identical, first_diff, lp_diff = 0, [], 0.0
    for a, b in zip(base, other, strict=True):
        ids_a, ids_b = a["token_ids"], b["token_ids"]
        same = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y),
                    min(len(ids_a), len(ids_b)))
        identical += ids_a == ids_b
        first_diff.append(None if ids_a == ids_b else same)
        for x, y in zip(a["logprobs"][:same], b["logprobs"][:same], strict=False):
            lp_diff = max(lp_diff, abs(x - y))
    return {"prompts_identical": identical, "prompts": len(base), "first_difference": first_diff,
            "max_abs_logprob_diff": lp_diff}


def weight_bytes(model_dir: Path, tied: bool) -> int:
    """Bytes a decode step streams from the checkpoint's tensors: all but an untied
    embedding table (a step gathers a few of its rows)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * (2 if t.get_dtype() in ("BF16", "F16") else 4)
    return total


def kv_bytes(cfg: ModelConfig, context: int) -> int:
    """bf16 K and V of one sequence of `context` tokens, all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="a model directory or 'default'")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tp", default="1,2", help="TP sizes; the first is the baseline")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=5, help="log probabilities per token")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes timed ('' none)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--extra", default="", help="more flags for `stagemesh serve`")
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/tp-{dt.date.today()}.json"))
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    vocab = cfg.vocab_size
    tps = [int(x) for x in args.tp.split(",")]
    batches = [int(x) for x in args.batches.split(",") if x]
    config: dict[str, Any] = {
        "model": str(args.model), "device": args.device, "stages": 1, "tp": tps,
        "prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "context": args.context, "extra": args.extra, "revision": git_revision()}
    roof: dict[str, float] = {}
    if args.device.startswith("cuda"):
        from benchmarks.runtime_vs_hf import roofline

        roof = roofline()
        config["card"] = roof
    weights = weight_bytes(model_dir, cfg.tie_word_embeddings) if roof else 0
    print(config, flush=True)
    prompts = seeded_prompts(args.prompts, args.prompt_len, vocab)
    max_seqs = max([args.prompts, *batches])
    outputs: dict[int, list[dict[str, Any]]] = {}
    rows: list[dict[str, Any]] = []
    for tp in tps:
        print(f"TP {tp}: starting the mesh", flush=True)
        with Mesh("--model", str(model_dir), "--stages", "1", "--tp", str(tp),
                  "--device", args.device, "--max-num-seqs", str(max_seqs),
                  *args.extra.split(), timeout=900) as mesh:
            outputs[tp] = asyncio.run(greedy(mesh.address, prompts, args.max_tokens, args.top))
            row: dict[str, Any] = {"tp": tp, **compare(outputs[tps[0]], outputs[tp])}
            for batch in batches:
                rate = asyncio.run(decode_rate(mesh.address, batch, args.context, vocab,
                                               args.window, 4 * args.context))
                row[f"b{batch}_ms_per_step"] = rate["ms_per_step"]
                row[f"b{batch}_stage_step_ms"] = stage_figures(mesh.address)[0]["step_ms"]
                if roof:
                    bytes_per_card = (weights + batch * kv_bytes(cfg, args.context)) / tp
                    row[f"b{batch}_roofline_ms"] = 1e3 * bytes_per_card / (
                        roof["copy_TBps"] * 1e12)
                print(f"TP {tp}, batch {batch}: {rate}", flush=True)
        rows.append(row)
    write_json(args.out, config, [{**r, "outputs": outputs[r["tp"]]} for r in rows])
    print_table([{k: v for k, v in r.items() if k != "first_difference"} for r in rows])


if __name__ == "__main__":
    main()
