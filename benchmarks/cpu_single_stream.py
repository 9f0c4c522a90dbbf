"""Single-stream decode on CPU: the stage runtime (one process, 1 stage) beside HF
transformers `generate` on the same default model, same prompt, same run (W2-like, small).

    python -m benchmarks.cpu_single_stream --out benchmarks/results/cpu-single-stream.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from pathlib import Path

import torch

from benchmarks.report import git_revision, print_table, write_json
from foundation.modelstore import resolve_model
from stage_worker.offline import LocalPipeline, LocalPipelineConfig
from stage_worker.step_input import SeqChunk


def ours(pipe: LocalPipeline, prompt: list[int], new: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s) for greedy decoding of `new` tokens."""
    table = list(range(-(-(len(prompt) + new) // 16)))
    t0 = time.perf_counter()
    tok = int(pipe.step([SeqChunk(0, 0, len(prompt), table)], torch.tensor(prompt))[0].argmax())
    t1 = time.perf_counter()
    for pos in range(len(prompt), len(prompt) + new - 1):
        tok = int(pipe.step([SeqChunk(0, pos, 1, table)], torch.tensor([tok]))[0].argmax())
    t2 = time.perf_counter()
    return t1 - t0, (new - 1) / (t2 - t1)


def hf(model: torch.nn.Module, prompt: list[int], new: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=2)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)  # type: ignore[operator]
    t1 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)  # type: ignore[operator]
    t2 = time.perf_counter()
    return t1 - t0, (new - 1) / ((t2 - t1) - (t1 - t0))


def main() -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=Path(
        f"benchmarks/results/cpu-single-stream-{dt.date.today()}.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("default")
    prompt = torch.randint(100, 40000, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    config = {"model": "smollm2-135m (SmolLM2-135M-Instruct, real weights)", "dtype": "float32",
              "device": "cpu", "threads": args.threads, "prompt_tokens": args.prompt_len,
              "output_tokens": args.new, "runs": args.runs, "stages": 1, "tp": 1,
              "kernels": "torch reference", "revision": git_revision()}
    print(config)
    pipe = LocalPipeline(LocalPipelineConfig(model_dir, 1, num_blocks=64))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results: dict[str, list[tuple[float, float]]] = {"stagemesh runtime": [], "HF generate": []}
    with torch.inference_mode():
        ours(pipe, prompt, 8)  # warm-up both
        hf(model, prompt, 8)
        for _ in range(args.runs):  # interleaved so drift hits both alike
            results["stagemesh runtime"].append(ours(pipe, prompt, args.new))
            results["HF generate"].append(hf(model, prompt, args.new))
    rows = [{"engine": k, "ttft_ms": statistics.median(r[0] for r in v) * 1e3,
             "decode_tok_s": statistics.median(r[1] for r in v)} for k, v in results.items()]
    rows[0]["vs_hf"] = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"]
    rows[1]["vs_hf"] = 1.0
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
