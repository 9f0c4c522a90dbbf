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


@pytest.mark.parametrize(("bad", "says"), [
    (["serve", "--stages", "0"], "argument --stages: must be at least 1, got 0"),
    (["serve", "--tp", "0"], "argument --tp: must be at least 1, got 0"),
    (["serve", "--standby", "-1"], "argument --standby: must be at least 0, got -1"),
    (["serve", "--port", "70000"], "argument --port: must be a port number, 0 to 65535"),
    (["serve", "--gateway-port", "-1"], "argument --gateway-port: must be at least 0"),
    (["serve", "--num-blocks", "0"], "argument --num-blocks: must be at least 1, got 0"),
    (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: must be at least 1"),
    (["serve", "--stream-interval", "0"], "argument --stream-interval: must be at least 1"),
    (["serve", "--run-ahead-depth", "1"], "argument --run-ahead-depth: must be at least 2"),
    (["serve", "--run-ahead-budget-ms", "-5"], "argument --run-ahead-budget-ms: must be 0 or more"),
    (["router", "--run-ahead-budget-ms", "x"], "argument --run-ahead-budget-ms: not a number of "),
    (["serve", "--step-timeout", "0"], "argument --step-timeout: must be more than 0 seconds"),
    (["router", "--max-model-len", "-1"], "argument --max-model-len: must be at least 0"),
    (["router", "--max-queued-requests", "0"], "argument --max-queued-requests: must be at "),
    (["router", "--micro-batches", "-1"], "argument --micro-batches: must be at least 0"),
    (["router", "--metrics-port", "65536"], "argument --metrics-port: must be a port number"),
    (["stage", "--block-size", "0"], "argument --block-size: must be at least 1, got 0"),
    (["stage", "--dataplane-port", "x"], "argument --dataplane-port: not a whole number: 'x'"),
    (["stage", "--stage-index", "-1"], "argument --stage-index: must be at least 0"),
    (["gateway", "--max-body-bytes", "0"], "argument --max-body-bytes: must be at least 1"),
    (["gateway", "--request-timeout", "0"], "argument --request-timeout: must be more than 0"),
])
def test_a_service_flag_out_of_range_is_one_line_before_anything_starts(
        bad: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Counts, ports and timeouts are checked on the command line (exit 2, the flag and its
    bound named), where they used to reach a child process and end it in a traceback, or
    be taken as given (a port past 65535, a stream interval of 0, a negative standby)."""
    with pytest.raises(SystemExit) as info:
        main(bad)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
