"""The `stagemesh` command: arguments, dispatch, and ModelError → exit 2 without a traceback."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from foundation.modelstore import DEFAULT_MODEL, ModelError
from foundation.modelstore.store import marker_identity
from stagemesh.cli import build_parser, main
from tests.model_dirs import truncate, write_tiny_model

REPO = Path(__file__).resolve().parents[2]


def plant_default_model(home: Path) -> Path:
    """A tiny model where the default model goes, with a valid import marker."""
    dest = write_tiny_model(home / "models" / DEFAULT_MODEL.name)
    (dest / "stagemesh-import.json").write_text(json.dumps(marker_identity(DEFAULT_MODEL)))
    return dest


def test_fetch_model_prints_the_directory(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = plant_default_model(home)
    assert main(["fetch-model"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{dest}\n"
    assert captured.err == ""  # already imported: nothing to report


def test_fetch_model_on_damaged_model_exits_2(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = plant_default_model(home)
    expected, found = truncate(dest / "model.safetensors", 3)
    assert main(["fetch-model"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"stagemesh: error: {dest / 'model.safetensors'} is truncated (expected {expected:,} "
        f"bytes, found {found:,}): run `stagemesh fetch-model --force` to re-import the "
        "default model\n"
    )


def test_fetch_model_error_in_a_real_process_has_no_traceback(home: Path) -> None:
    dest = plant_default_model(home)
    (dest / "tokenizer.json").unlink()
    result = subprocess.run(
        [sys.executable, "-m", "stagemesh.cli", "fetch-model"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "STAGEMESH_HOME": str(home)},
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"stagemesh: error: {dest / 'tokenizer.json'} is missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_defaults() -> None:
    args = build_parser().parse_args(["generate", "first prompt", "second prompt"])
    assert args.prompt == ["first prompt", "second prompt"]
    assert (args.model, args.chat, args.max_tokens, args.temperature) == ("default", False, 64, 0.0)
    assert (args.top_p, args.top_k, args.seed) == (None, None, None)
    assert (args.stages, args.device, args.dtype) == (1, "auto", "auto")


def test_generate_options() -> None:
    args = build_parser().parse_args([
        "generate", "hi", "--model", "/m", "--chat", "--max-tokens", "8", "--temperature", "0.7",
        "--top-p", "0.9", "--top-k", "40", "--seed", "3", "--stages", "2", "--device", "cpu",
        "--dtype", "bfloat16",
    ])
    assert vars(args) | {"handler": None} == {
        "command": "generate", "prompt": ["hi"], "model": "/m", "chat": True, "max_tokens": 8,
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3, "stages": 2, "device": "cpu",
        "dtype": "bfloat16", "handler": None,
    }


@pytest.mark.parametrize("bad", [
    ["generate"],  # no prompt
    ["generate", "hi", "--max-tokens", "0"],
    ["generate", "hi", "--temperature", "-1"],
    ["generate", "hi", "--top-p", "1.5"],
    ["generate", "hi", "--top-k", "many"],
    ["generate", "hi", "--stages", "0"],
    ["generate", "hi", "--device", "tpu"],
    [],  # no subcommand
])
def test_bad_arguments_exit_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(bad)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def fake_offline(monkeypatch: pytest.MonkeyPatch, run: Callable[[argparse.Namespace], int]) -> None:
    """Stands in for the `stagemesh.generate` module (which loads torch and the model)."""
    module = types.ModuleType("stagemesh.generate")
    module.generate_command = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "stagemesh.generate", module)


def test_generate_dispatches_to_the_generate_command(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []

    def run_generate(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    fake_offline(monkeypatch, run_generate)
    assert main(["generate", "--chat", "What is the capital of France?"]) == 0
    assert seen[0].prompt == ["What is the capital of France?"] and seen[0].chat


def test_model_error_from_generate_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run_generate(args: argparse.Namespace) -> int:
        raise ModelError("/models/x/config.json is missing")

    fake_offline(monkeypatch, run_generate)
    assert main(["generate", "hi", "--model", "/models/x"]) == 2
    assert capsys.readouterr().err == "stagemesh: error: /models/x/config.json is missing\n"


@pytest.mark.parametrize(("layers", "stages"), [("1,2", "2"), ("2", "2"), ("1,1", "3")])
def test_serve_refuses_a_layer_split_that_does_not_fit(layers: str, stages: str,
                                                       tmp_path: Path) -> None:
    """`serve --layers` is checked against the model before any process starts."""
    model = write_tiny_model(tmp_path / "m")  # 2 layers
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 16}))
    result = subprocess.run(
        [sys.executable, "-m", "stagemesh", "serve", "--model", str(model), "--stages", stages,
         "--layers", layers, "--gateway-port", "0"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode != 0
    assert "--layers:" in result.stderr and "summing to 2" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("flag", "value", "attr", "bad"),
                         [("--quantization", "fp8", "quantization", "int4"),
                          ("--kv-cache-dtype", "fp8", "kv_cache_dtype", "int4")])
def test_serve_passes_stage_storage_flags_to_every_stage(tmp_path: Path, flag: str, value: str,
                                                         attr: str, bad: str) -> None:
    from stagemesh.launcher import build_children
    from tests.default_model import default_model_dir

    parser = build_parser()
    serve = parser.parse_args(["serve", "--model", str(default_model_dir()), "--device", "cpu",
                               "--stages", "2", flag, value])
    stages = [c for c in build_children(serve, tmp_path) if c.role.startswith("stage")]
    assert len(stages) == 2
    for child in stages:
        assert getattr(parser.parse_args(child.argv[3:]), attr) == value  # after -m stagemesh
    with pytest.raises(SystemExit):
        parser.parse_args(["stage", flag, bad])
