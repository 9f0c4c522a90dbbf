"""Where one stage's GPU memory goes while it starts: after its weights, the profile, the KV
pool, each capture and the warm-up, against its share of the card.

A stage sizes its KV pool to what is left of `--gpu-memory-utilization` of the card after
what it profiled. Anything it holds that the profile did not count comes out of the card's
last part, and stages sharing a card add theirs up (`serve` splits 0.9 among them). This
builds one stage's runner alone on the card, as a stage of `--stages` with index `--index`
would be, and reads after each phase what PyTorch has allocated and reserved and what the
card has in use (this process is the card's only user, so the card's use minus PyTorch's
reserve is the CUDA context and the libraries' own memory).

    python -m benchmarks.stage_memory --model /tmp/m8b --stages 4 --index 3 --out m.json
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import git_revision, print_table, write_json
from foundation.model_config import ModelConfig
from stage_worker import runner as runner_module
from stage_worker.parallel import TPGroup
from stage_worker.partition import partition_layers

_PHASES = ("_profile_cuda", "_capture_graphs", "_capture_mixed_graphs", "_warm_up")
GIB = 2**30


def _reading(phase: str, device: torch.device) -> dict[str, Any]:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"after": phase, "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "reserved_gib": reserved / GIB, "card_used_gib": (total - free) / GIB,
            "not_torch_gib": (total - free - reserved) / GIB}


def _watch(rows: list[dict[str, Any]], device: torch.device) -> None:
    """A reading after each start-up phase of every StageRunner built from now on."""
    cls = runner_module.StageRunner
    for name in _PHASES:
        method = getattr(cls, name)

        def watched(self: Any, *args: Any, _method: Any = method, _name: str = name) -> Any:
            out = _method(self, *args)
            rows.append(_reading(_name.lstrip("_"), device))
            return out
        setattr(cls, name, watched)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--stages", type=int, default=1, help="stages sharing the card")
    ap.add_argument("--index", type=int, default=0, help="which of them to build")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="the card's share of all the stages together (serve's default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/stage-memory.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("stage_memory measures a stage on a GPU: this machine has no CUDA "
                         "device (run it on the GPU machine)")
    device = torch.device("cuda", torch.cuda.current_device())
    model_cfg = ModelConfig.from_dir(args.model)
    layers = partition_layers(model_cfg.num_layers, args.stages)[args.index]
    share = args.gpu_memory_utilization / args.stages
    total = torch.cuda.mem_get_info(device)[1]
    config = {"model": str(args.model), "stages": args.stages, "index": args.index,
              "layers": f"{layers.start}-{layers.end - 1}", "share": share,
              "share_gib": share * total / GIB, "card": torch.cuda.get_device_name(device),
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_num_seqs": args.max_num_seqs, "torch": torch.__version__,
              "revision": git_revision()}
    print(config)
    rows: list[dict[str, Any]] = [_reading("cuda init", device)]
    _watch(rows, device)
    cfg = runner_module.StageRunnerConfig(
        args.model, layers, torch.bfloat16, device, gpu_memory_utilization=share,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_held_seqs=args.max_num_seqs * args.stages)
    runner = runner_module.StageRunner(cfg, model_cfg, TPGroup())
    rows.append(_reading("ready", device))
    config["kv_blocks"] = runner.num_blocks
    # The share bounds what PyTorch reserves; the CUDA context (not_torch) comes out of the
    # card's part that no stage's share includes (`serve` hands out 0.9 of it).
    config["within_share"] = rows[-1]["reserved_gib"] <= config["share_gib"]
    for row in rows:
        row["over_share_gib"] = row["reserved_gib"] - config["share_gib"]
    print_table(rows)
    print(f"KV blocks {runner.num_blocks}; when ready PyTorch reserves "
          f"{rows[-1]['reserved_gib']:.2f} GiB against a share of {config['share_gib']:.2f} "
          f"(the card's use {rows[-1]['card_used_gib']:.2f})")
    write_json(args.out, config, rows)


if __name__ == "__main__":
    main()
