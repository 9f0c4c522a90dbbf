"""Validation of a model directory in Hugging Face layout.

A model directory holds:
  config.json                      JSON object with the architecture (REQUIRED_CONFIG_KEYS)
  model.safetensors                the weights in one file, or
  model.safetensors.index.json     {"weight_map": {tensor name: shard file}} + every shard it names
  tokenizer.json                   a `tokenizers` tokenizer
  tokenizer_config.json            optional; chat template and special tokens

Checks read file headers and sizes only (never tensor data), so they take milliseconds even for
large models and run every time a model is resolved. Every failure is a `ModelError` that names
the file and says how to repair it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.modelstore.errors import ModelError

CONFIG = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Written last by the default-model import; its presence marks a directory stagemesh built.
IMPORT_MARKER = "stagemesh-import.json"

REQUIRED_CONFIG_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
)
# safetensors refuses headers above 100 MB; a larger length prefix means a corrupt file.
_MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class ModelFiles:
    """The files of a validated model directory."""

    root: Path
    config: Path
    weights: tuple[Path, ...]  # one file, or the shards in name order
    tokenizer: Path
    tokenizer_config: Path | None  # None when the directory has none


def repair_hint(model_dir: Path, fix: str = "re-download it") -> str:
    """What the user should do about a damaged file in `model_dir`: `fix`, unless stagemesh
    imported the directory itself, when re-importing is the fix."""
    marker = model_dir / IMPORT_MARKER
    if marker.is_file():
        try:
            source = json.loads(marker.read_text(encoding="utf-8")).get("source", "")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            source = ""
        if isinstance(source, str) and source.lower().endswith(".gguf"):
            return f"run `stagemesh import-model {source} --force` to import it again"
        return "run `stagemesh fetch-model --force` to re-import the default model"
    return fix


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """Parses `path` as a JSON object; `what` names the file's role in error messages."""
    if not path.is_file():
        raise ModelError(f"{path} is missing: the model directory needs {what}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(
            f"{path} is not valid JSON ({exc}): {repair_hint(path.parent)}"
        ) from None
    if not isinstance(value, dict):
        raise ModelError(
            f"{path} must hold a JSON object, found {type(value).__name__}: "
            f"{repair_hint(path.parent)}"
        )
    return value


def read_config(model_dir: Path) -> dict[str, Any]:
    """Returns config.json, checked for the keys every stage needs to build its layers."""
    path = model_dir / CONFIG
    config = read_json_object(path, "config.json (the model's architecture)")
    for key in REQUIRED_CONFIG_KEYS:
        value = config.get(key)
        if key == "model_type":
            ok = isinstance(value, str) and bool(value)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if not ok:
            expected = "a non-empty string" if key == "model_type" else "a positive integer"
            raise ModelError(f"{path}: `{key}` must be {expected}, found {value!r}")
    return config


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of `model_dir`: model.safetensors, or every shard the index names.

    Like transformers, a single model.safetensors wins over an index. Raises ModelError when
    neither exists, the index is malformed, or a shard it names is missing.
    """
    single = model_dir / SINGLE_WEIGHTS
    if single.is_file():
        return [single]
    index_path = model_dir / WEIGHTS_INDEX
    if not index_path.is_file():
        others = sorted(p.name for p in model_dir.glob("*.bin")) if model_dir.is_dir() else []
        found = f" (found only {', '.join(others)}: convert them to safetensors)" if others else ""
        raise ModelError(
            f"{model_dir} has no weights: expected {SINGLE_WEIGHTS} or {WEIGHTS_INDEX}{found}"
        )
    shards = sorted(set(_weight_map(index_path).values()))
    missing = [name for name in shards if not (model_dir / name).is_file()]
    if missing:
        raise ModelError(
            f"{model_dir / missing[0]} is missing: {WEIGHTS_INDEX} names "
            f"{len(shards)} shard(s) and {len(missing)} are absent ({', '.join(missing)}); "
            f"{repair_hint(model_dir, 'download the missing shard(s)')}"
        )
    return [model_dir / name for name in shards]


def check_weights(model_dir: Path) -> dict[str, Path]:
    """Checks every weight file's header against its size; returns {tensor name: file}.

    Catches truncated downloads, files that are not safetensors, tensors the index maps to a
    shard that lacks them, and tensors stored twice. Reads headers only.
    """
    index_path = model_dir / WEIGHTS_INDEX
    files = weight_files(model_dir)
    hint = repair_hint(model_dir, "re-download the model")
    located: dict[str, Path] = {}
    for path in files:
        for name in _checked_tensor_names(path):
            if name in located:
                raise ModelError(
                    f"{path} and {located[name]} both hold tensor `{name}`: "
                    f"the weights are inconsistent; {hint}"
                )
            located[name] = path
    if files[0].name != SINGLE_WEIGHTS:
        for name, shard in _weight_map(index_path).items():
            if located.get(name) != model_dir / shard:
                raise ModelError(
                    f"{model_dir / shard} lacks tensor `{name}` that {WEIGHTS_INDEX} places "
                    f"there: {hint}"
                )
    return located


def check_tokenizer(model_dir: Path) -> tuple[Path, Path | None]:
    """Checks tokenizer.json loads with `tokenizers`; returns it and tokenizer_config.json."""
    path = model_dir / TOKENIZER
    read_json_object(path, "tokenizer.json (a `tokenizers` tokenizer)")
    from tokenizers import Tokenizer  # deferred: the import costs ~0.1 s

    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust error types are not exported
        raise ModelError(
            f"{path} is not a valid tokenizer ({exc}): {repair_hint(model_dir)}"
        ) from None
    config_path = model_dir / TOKENIZER_CONFIG
    if not config_path.exists():
        return path, None
    tokenizer_config = read_json_object(config_path, "tokenizer_config.json")
    template = tokenizer_config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelError(
            f"{config_path}: `chat_template` must be a string, found {type(template).__name__}"
        )
    return path, config_path


def check_model_dir(model_dir: Path) -> ModelFiles:
    """Validates a whole model directory (config, weights, tokenizer); see the module doc."""
    if not model_dir.exists():
        raise ModelError(
            f"model directory {model_dir} does not exist: pass `--model default` for the "
            "bundled SmolLM2-135M-Instruct, or a directory in Hugging Face layout"
        )
    if not model_dir.is_dir():
        raise ModelError(
            f"{model_dir} is a file: `--model` takes a directory in Hugging Face layout "
            f"({CONFIG}, {SINGLE_WEIGHTS} or shards, {TOKENIZER})"
        )
    read_config(model_dir)
    located = check_weights(model_dir)
    tokenizer, tokenizer_config = check_tokenizer(model_dir)
    return ModelFiles(
        root=model_dir,
        config=model_dir / CONFIG,
        weights=tuple(sorted(set(located.values()))),
        tokenizer=tokenizer,
        tokenizer_config=tokenizer_config,
    )


def _weight_map(index_path: Path) -> dict[str, str]:
    """The index's {tensor name: shard file name}, checked for shape."""
    index = read_json_object(index_path, WEIGHTS_INDEX)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelError(f"{index_path}: `weight_map` must be a non-empty object")
    for name, shard in weight_map.items():
        # A shard must be a plain file name in the model directory, never a path out of it.
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise ModelError(
                f"{index_path}: tensor `{name}` maps to {shard!r}, not a file name "
                "in the model directory"
            )
    return weight_map


def _checked_tensor_names(path: Path) -> list[str]:
    """Tensor names of one safetensors file, after checking its size against its header.

    Layout: 8-byte little-endian header length N, N bytes of JSON header
    ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the
    data; the file is exactly 8 + N + max(end) bytes long.
    """
    hint = repair_hint(path.parent)
    size = path.stat().st_size
    header_len, data_len = _read_header(path, size, hint)
    expected = 8 + header_len + data_len
    if size < expected:
        raise ModelError(
            f"{path} is truncated (expected {expected:,} bytes, found {size:,}): {hint}"
        )
    if size > expected:
        raise ModelError(
            f"{path} is larger than its header says (expected {expected:,} bytes, "
            f"found {size:,}): the file is corrupt; {hint}"
        )
    # The library's own checks (dtypes, shapes against offsets, overlaps) on top of ours.
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as opened:
            return list(opened.keys())
    except Exception as exc:  # SafetensorError is not importable on every version
        raise ModelError(f"{path} is not a valid safetensors file ({exc}): {hint}") from None


def _read_header(path: Path, size: int, hint: str) -> tuple[int, int]:
    """(header length N, data length the header implies) of a safetensors file."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelError(
                f"{path} is truncated (expected at least 8 bytes, found {size}): {hint}"
            )
        header_len = int.from_bytes(prefix, "little")
        if header_len > _MAX_HEADER_BYTES:
            raise ModelError(
                f"{path} is not a safetensors file (header length {header_len:,} bytes is "
                f"over the {_MAX_HEADER_BYTES:,} limit): {hint}"
            )
        if 8 + header_len > size:
            raise ModelError(
                f"{path} is truncated (expected at least {8 + header_len:,} bytes for its "
                f"header, found {size:,}): {hint}"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, IndexError,
            ValueError, AttributeError) as exc:
        raise ModelError(f"{path} has a corrupt safetensors header ({exc!r}): {hint}") from None
    return header_len, max(ends, default=0)
