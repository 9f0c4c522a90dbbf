"""`serve --layers auto`: the layers of each stage from the memory its device has free.

A GPU's free memory is read in a short child process (querying it here would leave a CUDA
context, and its memory, in `serve` for the mesh's whole life). Stages sharing a device
share its free memory evenly, as their `--gpu-memory-utilization` does; 90 % of it is
counted, as that flag's default. On CPU every stage draws on the same host memory, so the
split is the even one.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence

from foundation.model_config import ModelConfig
from foundation.modelstore.imports import expected_tensors
from stage_worker.partition import balance_layers, partition_layers

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FREE_MEMORY = ("import json, sys, torch; print(json.dumps([torch.cuda.mem_get_info(int(i))[0] "
                "for i in sys.argv[1:]]))")


def free_memory(devices: Sequence[str]) -> dict[str, int]:
    """Free bytes of each distinct `cuda:N` device, read in a child process."""
    distinct = sorted(set(devices))
    indices = [d.partition(":")[2] or "0" for d in distinct]
    done = subprocess.run([sys.executable, "-c", _FREE_MEMORY, *indices], capture_output=True,
                          text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"could not read the GPUs' free memory: {done.stderr.strip()[-500:]}")
    return dict(zip(distinct, json.loads(done.stdout), strict=True))


def auto_layers(cfg: ModelConfig, devices: Sequence[str], share_of: dict[str, int],
                dtype: str, free: dict[str, int] | None = None) -> tuple[int, ...]:
    """Layers per stage (pipeline order) for stages on `devices`, `share_of[d]` processes
    sharing device d. `dtype`: the stages' ("auto": the checkpoint's). `free`: free bytes
    per device (read from the GPUs when None)."""
    if all(d == "cpu" for d in devices):
        return tuple(len(r) for r in partition_layers(cfg.num_layers, len(devices)))
    free = free if free is not None else free_memory(devices)
    size = _DTYPE_BYTES.get(cfg.torch_dtype if dtype == "auto" else dtype, 2)
    layer_params = sum(math.prod(shape) for name, shape in expected_tensors(cfg).items()
                       if name.startswith("model.layers.0."))
    h = cfg.hidden_size
    embedding = cfg.vocab_size * h * size  # the last stage holds the head (a copy if tied)
    budgets = [int(free[d] * 0.9) // share_of[d] for d in devices]
    return tuple(balance_layers(cfg.num_layers, budgets, layer_params * size, embedding,
                                embedding + h * size, 2 * cfg.num_kv_heads * cfg.head_dim * size))
