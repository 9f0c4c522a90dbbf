"""Load a stage's weights from HF-layout safetensors (single file or sharded with an index).

Reads only the tensors this stage's layers need and, through `get_slice`, only this rank's
rows or columns of them: a TP rank never materialises the whole checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from stage_worker.layers.weights import TensorSource

log = logging.getLogger("stagemesh.loader")

# Our fused modules and the checkpoint modules they are built from, with the shard id each
# checkpoint tensor fills.
PACKED_MODULES: dict[str, list[tuple[str, str | int]]] = {
    "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
}


class WeightLoadError(Exception):
    """A checkpoint that does not hold what the model needs; the message names the tensor."""


def checkpoint_index(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it.

    A single `model.safetensors` wins over an index file, as in HF transformers.
    """
    single = model_dir / "model.safetensors"
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (not a dict)
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        raise WeightLoadError(f"{model_dir} holds neither model.safetensors nor an index file")
    with open(index, encoding="utf-8") as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    return {name: model_dir / file for name, file in weight_map.items()}


def _wanted(model: nn.Module, tied: bool, names: Mapping[str, object]
            ) -> Iterator[tuple[nn.Module, str, str, str | int | None]]:
    """Yield (module, checkpoint tensor name, param name, shard) for every loadable param."""
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        if not hasattr(module, "load"):
            continue
        prefix, _, leaf = mod_name.rpartition(".")
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied lm_head shares the embedding on a one-stage model
                continue
            seen.add(id(param))
            if leaf in PACKED_MODULES:
                for src_leaf, shard in PACKED_MODULES[leaf]:
                    yield module, f"{prefix}.{src_leaf}.{pname}", pname, shard
            elif mod_name == "lm_head" and (tied or "lm_head.weight" not in names):
                yield module, "model.embed_tokens.weight", pname, None
            else:
                yield module, f"{mod_name}.{pname}", pname, None


def load_stage_weights(model: nn.Module, model_dir: Path, tied: bool) -> int:
    """Fill every parameter of `model` from the checkpoint in `model_dir`.

    Returns the number of checkpoint tensors read. Raises WeightLoadError naming the first
    tensor the checkpoint lacks.
    """
    names = checkpoint_index(model_dir)
    by_file: dict[Path, list[tuple[nn.Module, str, str, str | int | None]]] = defaultdict(list)
    for module, ckpt_name, pname, shard in _wanted(model, tied, names):
        if ckpt_name not in names:
            raise WeightLoadError(
                f"checkpoint in {model_dir} has no tensor {ckpt_name!r} (needed by this stage)"
            )
        by_file[names[ckpt_name]].append((module, ckpt_name, pname, shard))
    total = sum(len(v) for v in by_file.values())
    done, started, last_report = 0, time.monotonic(), time.monotonic()
    for path, items in sorted(by_file.items()):
        with safe_open(str(path), framework="pt") as f:
            for module, ckpt_name, _pname, shard in items:
                module.load(ckpt_name, f.get_slice(ckpt_name), shard)  # type: ignore[operator]
                done += 1
                if time.monotonic() - last_report > 2.0:
                    log.info("loading weights: %d/%d tensors", done, total)
                    last_report = time.monotonic()
    log.info("loaded %d tensors from %d file(s) in %.1fs", total, len(by_file),
             time.monotonic() - started)
    return total


def load_stage_weights_from_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor],
                                    tied: bool) -> int:
    """Like `load_stage_weights`, from tensors already in memory under checkpoint names
    (benchmarks that share one random model with HF transformers)."""
    count = 0
    for module, ckpt_name, _pname, shard in _wanted(model, tied, dict.fromkeys(tensors)):
        if ckpt_name not in tensors:
            raise WeightLoadError(f"no tensor {ckpt_name!r} among the given weights")
        module.load(ckpt_name, TensorSource(tensors[ckpt_name]), shard)  # type: ignore[operator]
        count += 1
    return count
