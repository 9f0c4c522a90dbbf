"""Start-up on damaged weights (real `stagemesh serve` and `stagemesh stage` processes): a
truncated file, a corrupt safetensors header or no weights at all is one `stagemesh:
error:` line naming the file, exit status 2, within seconds, no traceback, and nothing
reports ready (serve starts no process at all)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.default_model import default_model_dir

REPO = Path(__file__).resolve().parents[2]


def _damaged(tmp_path: Path, damage: str) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, model / name)
    weights = model / "model.safetensors"
    if damage == "truncated":
        with open(default_model_dir() / "model.safetensors", "rb") as f:
            weights.write_bytes(f.read(100_000))
    elif damage == "corrupt header":
        header = b'{"model.embed_tokens.weight": {"dtype": "F32", not json'
        weights.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
    return model


@pytest.mark.parametrize("damage", ["truncated", "corrupt header", "missing"])
@pytest.mark.parametrize("command", ["serve", "stage"])
def test_damaged_weights_are_one_clear_line(tmp_path: Path, damage: str, command: str) -> None:
    model = _damaged(tmp_path, damage)
    extra = ["--stages", "2"] if command == "serve" else []
    result = subprocess.run(
        [sys.executable, "-m", "stagemesh", command, "--model", str(model), "--device", "cpu",
         "--port", "0", *extra], capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**os.environ, "STAGEMESH_HOME": str(tmp_path / "home")})
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("stagemesh: error: "), result.stderr
    named = "model.safetensors" if damage != "missing" else str(model)
    assert named in lines[0], lines[0]
    assert "ready" not in result.stdout and "Traceback" not in result.stderr
