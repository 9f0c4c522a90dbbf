"""`serve --layers auto`: the split `serve` passes to its stages, from each device's free
memory (the GPU path with given free memory; the CPU path through serve's own children)."""

from __future__ import annotations

import json
from pathlib import Path

from foundation.model_config import ModelConfig
from stagemesh.cli import build_parser
from stagemesh.launcher import build_children
from stagemesh.placement import auto_layers
from tests.model_dirs import write_tiny_model

LLAMA3_8B = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                        head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
                        max_position_embeddings=8192, tie_word_embeddings=False,
                        torch_dtype="bfloat16")
GB = 1 << 30


def test_gpus_with_more_free_memory_take_more_layers() -> None:
    even = auto_layers(LLAMA3_8B, ["cuda:0", "cuda:1"], {"cuda:0": 1, "cuda:1": 1}, "auto",
                       free={"cuda:0": 80 * GB, "cuda:1": 80 * GB})
    assert even == (16, 16)
    uneven = auto_layers(LLAMA3_8B, ["cuda:0", "cuda:1"], {"cuda:0": 1, "cuda:1": 1}, "auto",
                         free={"cuda:0": 140 * GB, "cuda:1": 40 * GB})
    assert uneven[0] > 2 * uneven[1] and sum(uneven) == 32
    # two stages sharing one card split it; a stage alone on the other has it all
    shared = auto_layers(LLAMA3_8B, ["cuda:0", "cuda:0", "cuda:1"], {"cuda:0": 2, "cuda:1": 1},
                         "auto", free={"cuda:0": 80 * GB, "cuda:1": 80 * GB})
    assert shared[2] > shared[0] and shared[2] > shared[1]


def test_serve_passes_the_auto_split_to_every_stage(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")  # 2 layers
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 16}))
    args = build_parser().parse_args(["serve", "--model", str(model), "--stages", "2",
                                      "--device", "cpu", "--layers", "auto"])
    children = build_children(args, tmp_path / "work")
    stages = [c for c in children if c.role.startswith("stage")]
    assert len(stages) == 2
    for child in stages:
        flag = child.argv.index("--layers")
        assert child.argv[flag + 1] == "1,1"
