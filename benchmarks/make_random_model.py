"""Write a random-weight checkpoint (seeded) of a benchmark shape in HF layout, with the
tokenizer files of another model directory, so the mesh can serve it anywhere.

    python -m benchmarks.make_random_model --shape smollm2-135m --tokenizer DIR --out DIR
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from benchmarks.shapes import SHAPES
from kernels.platform import PLATFORM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[args.shape])
    torch.set_default_dtype(getattr(torch, args.dtype))
    with PLATFORM.default_device:
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.tokenizer / name).exists():
            shutil.copy(args.tokenizer / name, args.out / name)
    print(f"wrote {args.shape} ({args.dtype}, random, seed 0) to {args.out}")


if __name__ == "__main__":
    main()
