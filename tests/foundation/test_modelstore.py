"""Model directory validation: every broken layout ends in a ModelError naming the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from foundation.modelstore import (
    ModelError,
    check_model_dir,
    check_weights,
    read_config,
    resolve_model,
    stagemesh_home,
    weight_files,
)
from tests.model_dirs import TINY_CONFIG, tiny_tensors, truncate

SHARD_2 = "model-00002-of-00003.safetensors"


def model_error(model_dir: Path) -> str:
    with pytest.raises(ModelError) as info:
        resolve_model(str(model_dir))
    return str(info.value)


# --- good directories ---------------------------------------------------------------------------


def test_single_file_model_resolves(tiny_model: Path) -> None:
    assert resolve_model(str(tiny_model)) == tiny_model
    assert weight_files(tiny_model) == [tiny_model / "model.safetensors"]
    located = check_weights(tiny_model)
    assert sorted(located) == sorted(tiny_tensors())
    assert set(located.values()) == {tiny_model / "model.safetensors"}
    assert read_config(tiny_model) == TINY_CONFIG


def test_sharded_model_resolves(sharded_model: Path) -> None:
    assert resolve_model(str(sharded_model)) == sharded_model
    shards = [sharded_model / f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert weight_files(sharded_model) == shards
    files = check_model_dir(sharded_model)
    assert files.weights == tuple(shards)
    assert files.tokenizer == sharded_model / "tokenizer.json"
    assert files.tokenizer_config is None
    index = json.loads((sharded_model / "model.safetensors.index.json").read_text())
    assert {k: v.name for k, v in check_weights(sharded_model).items()} == index["weight_map"]


def test_relative_path_resolves_to_absolute(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tiny_model.parent)
    assert resolve_model(tiny_model.name) == tiny_model


# --- weights --------------------------------------------------------------------------------------


def test_truncated_shard_names_file_and_sizes(sharded_model: Path) -> None:
    expected, found = truncate(sharded_model / SHARD_2, 10)
    message = model_error(sharded_model)
    assert f"{sharded_model / SHARD_2} is truncated" in message
    assert f"expected {expected:,} bytes, found {found:,}" in message
    assert "re-download it" in message


def test_truncated_single_file(tiny_model: Path) -> None:
    expected, found = truncate(tiny_model / "model.safetensors", 1)
    message = model_error(tiny_model)
    assert f"model.safetensors is truncated (expected {expected:,} bytes, found {found:,})" \
        in message


def test_file_truncated_inside_header(tiny_model: Path) -> None:
    path = tiny_model / "model.safetensors"
    truncate(path, path.stat().st_size - 20)  # keep 20 bytes: length prefix + part of header
    assert f"{path} is truncated (expected at least" in model_error(tiny_model)


def test_file_shorter_than_length_prefix(tiny_model: Path) -> None:
    path = tiny_model / "model.safetensors"
    path.write_bytes(b"\x01\x02")
    assert f"{path} is truncated (expected at least 8 bytes, found 2)" in model_error(tiny_model)


def test_trailing_bytes_are_corruption(tiny_model: Path) -> None:
    path = tiny_model / "model.safetensors"
    with path.open("ab") as f:
        f.write(b"\0" * 16)
    assert f"{path} is larger than its header says" in model_error(tiny_model)


def test_not_a_safetensors_file(tiny_model: Path) -> None:
    path = tiny_model / "model.safetensors"
    path.write_bytes(b"<html>503 Service Unavailable</html>" * 10)  # a proxy error page
    assert f"{path} is not a safetensors file" in model_error(tiny_model)


def test_corrupt_header_json(tiny_model: Path) -> None:
    path = tiny_model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("#")  # the header's opening brace
    path.write_bytes(bytes(data))
    assert f"{path} has a corrupt safetensors header" in model_error(tiny_model)


def test_missing_shard_named_in_index(sharded_model: Path) -> None:
    (sharded_model / SHARD_2).unlink()
    message = model_error(sharded_model)
    assert f"{sharded_model / SHARD_2} is missing" in message
    assert "names 3 shard(s) and 1 are absent" in message


def test_index_places_tensor_in_wrong_shard(sharded_model: Path) -> None:
    index_path = sharded_model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(n for n, s in index["weight_map"].items() if s != SHARD_2)
    index["weight_map"][name] = SHARD_2
    index_path.write_text(json.dumps(index))
    assert f"{sharded_model / SHARD_2} lacks tensor `{name}`" in model_error(sharded_model)


def test_index_shard_outside_model_dir(sharded_model: Path) -> None:
    index_path = sharded_model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    assert "not a file name in the model directory" in model_error(sharded_model)


def test_no_weights_mentions_bin_files(tiny_model: Path) -> None:
    (tiny_model / "model.safetensors").rename(tiny_model / "pytorch_model.bin")
    message = model_error(tiny_model)
    assert "has no weights: expected model.safetensors or model.safetensors.index.json" in message
    assert "pytorch_model.bin: convert them to safetensors" in message


# --- config and tokenizer ------------------------------------------------------------------------


def test_corrupt_config_json(tiny_model: Path) -> None:
    (tiny_model / "config.json").write_text('{"model_type": "llama",')
    assert f"{tiny_model / 'config.json'} is not valid JSON" in model_error(tiny_model)


def test_config_not_an_object(tiny_model: Path) -> None:
    (tiny_model / "config.json").write_text("[1, 2]")
    assert "must hold a JSON object, found list" in model_error(tiny_model)


def test_config_missing_layer_count(tiny_model: Path) -> None:
    config = {k: v for k, v in TINY_CONFIG.items() if k != "num_hidden_layers"}
    (tiny_model / "config.json").write_text(json.dumps(config))
    assert "`num_hidden_layers` must be a positive integer, found None" in model_error(tiny_model)


def test_missing_config(tiny_model: Path) -> None:
    (tiny_model / "config.json").unlink()
    assert f"{tiny_model / 'config.json'} is missing" in model_error(tiny_model)


def test_missing_tokenizer(tiny_model: Path) -> None:
    (tiny_model / "tokenizer.json").unlink()
    assert f"{tiny_model / 'tokenizer.json'} is missing" in model_error(tiny_model)


def test_invalid_tokenizer(tiny_model: Path) -> None:
    (tiny_model / "tokenizer.json").write_text('{"model": {"type": "Nonsense"}}')
    assert f"{tiny_model / 'tokenizer.json'} is not a valid tokenizer" in model_error(tiny_model)


def test_chat_template_must_be_a_string(tiny_model: Path) -> None:
    (tiny_model / "tokenizer_config.json").write_text('{"chat_template": [{"name": "x"}]}')
    assert "`chat_template` must be a string, found list" in model_error(tiny_model)


def test_missing_directory(tmp_path: Path) -> None:
    message = model_error(tmp_path / "nowhere")
    assert f"model directory {tmp_path / 'nowhere'} does not exist" in message
    assert "--model default" in message


def test_file_instead_of_directory(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"????")
    assert f"{weights} is a file" in model_error(weights)
    gguf = tmp_path / "model.gguf"  # a GGUF file is imported: this one cannot be read
    gguf.write_bytes(b"GGUF")
    assert f"{gguf}: not a readable GGUF file" in model_error(gguf)


def test_imported_model_hint_says_fetch_model_force(tiny_model: Path) -> None:
    (tiny_model / "stagemesh-import.json").write_text("{}")
    truncate(tiny_model / "model.safetensors", 4)
    assert "run `stagemesh fetch-model --force`" in model_error(tiny_model)


# --- home and imports -------------------------------------------------------------------------


def test_stagemesh_home_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.delenv("STAGEMESH_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert stagemesh_home() == tmp_path / "user" / ".cache" / "stagemesh"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert stagemesh_home() == tmp_path / "xdg" / "stagemesh"
    monkeypatch.setenv("STAGEMESH_HOME", str(tmp_path / "sm"))
    assert stagemesh_home() == tmp_path / "sm"


def test_import_pulls_in_no_torch() -> None:
    code = (
        "import sys, stagemesh.cli, foundation.modelstore;"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'});"
        "print(*bad)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
