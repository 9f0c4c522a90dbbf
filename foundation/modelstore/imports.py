"""`stagemesh import-model PATH` and `--model PATH`: any GGUF file of a supported architecture,
imported once into the model store, and any Hugging Face checkpoint directory, checked in
place.

A GGUF file is read by transformers (dequantized to fp32, `gguf_import`) into
`$STAGEMESH_HOME/models/<file stem>-<identity>`, where the identity is the file's absolute
path, size and modification time: the same file is imported once, a changed one again. Its
architecture is read from the GGUF header first (milliseconds), so an unsupported one is
refused before any tensor is read. Every model, imported or not, is checked before it is
served (`verify_model`): config, the tensor names and shapes the runtime loads, and the
tokenizer, all from file headers.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from foundation.model_config import SUPPORTED_MODEL_TYPES, ModelConfig
from foundation.modelstore.atomic import (
    exclusive,
    marker_matches,
    seal_import,
    swap_into_place,
)
from foundation.modelstore.errors import ModelError
from foundation.modelstore.layout import (
    TOKENIZER_CONFIG,
    check_model_dir,
    read_json_object,
)
from foundation.modelstore.progress import say

# GGUF's `general.architecture` -> the config's model_type (Mistral's GGUF files say llama).
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
_IMPORT_FORMAT = "gguf-file-v1"


def import_model(path: Path, home: Path, force: bool = False) -> Path:
    """The servable model directory for `path`: a GGUF file imported into `home`'s store
    (once), or a checkpoint directory checked in place. Progress and the checks' findings go
    to stderr.

    Raises:
        ModelError: not a GGUF file or a directory, an unsupported architecture or tensor
            type, or a checkpoint whose files, tensors or tokenizer do not fit its config.
    """
    path = path.expanduser().absolute()
    if path.is_dir():
        verify_model(path)
        return path
    if not path.is_file() or path.suffix.lower() != ".gguf":
        raise ModelError(f"{path}: not a GGUF file (*.gguf) or a checkpoint directory")
    gguf_architecture(path)  # refuse early, before transformers reads every tensor
    identity = _identity(path)
    dest = home / "models" / f"{path.stem}-{identity['key']}"
    if not force and marker_matches(dest, identity):
        return dest
    models = dest.parent
    models.mkdir(parents=True, exist_ok=True)
    with exclusive(models / f".{dest.name}.lock"):
        if not force and marker_matches(dest, identity):
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=models))
        try:
            from foundation.modelstore import gguf_import

            try:
                summary = gguf_import.import_gguf(path, tmp)
            except ModelError:
                raise
            except Exception as e:  # transformers' reader: a tensor type it cannot read, ...
                raise ModelError(f"{path}: transformers could not read this GGUF file "
                                 f"({type(e).__name__}: {e})") from None
            say(f"imported {summary.n_tensors} tensors ({summary.n_params / 1e6:.1f}M "
                f"params) in {summary.seconds:.1f} s")
            verify_model(tmp)
            seal_import(tmp, {**identity, "import_seconds": round(summary.seconds, 1),
                              "imported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            swap_into_place(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"ready: {dest}")
    return dest


def gguf_architecture(path: Path) -> str:
    """The model_type of a GGUF file's architecture, once its header shows that every tensor
    is of a type the import can read (float, or a quantization the `gguf` package
    dequantizes, which is what transformers' reader uses).

    Raises:
        ModelError: unreadable, an architecture the runtime does not implement, or a tensor
            type the import cannot dequantize (named with its tensor)."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader
        from gguf.quants import _type_traits as dequantizable
    except ImportError as e:
        raise ModelError(f"reading GGUF files needs the gguf extra ({e}): run "
                         "`pip install 'stagemesh[gguf]'`") from None
    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception as e:
        raise ModelError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    if arch not in GGUF_ARCHITECTURES:
        raise ModelError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))})")
    floats = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    readable = floats | set(dequantizable)
    for tensor in reader.tensors:
        if tensor.tensor_type not in readable:
            names = sorted(t.name for t in readable)
            raise ModelError(f"{path}: tensor {tensor.name} is stored as "
                             f"{tensor.tensor_type.name}, a GGUF type this import cannot "
                             f"dequantize (readable: {', '.join(names)}); convert the file "
                             "to one of them, e.g. with llama.cpp's llama-quantize")
    return GGUF_ARCHITECTURES[arch]


def verify_model(model_dir: Path) -> ModelConfig:
    """Check a checkpoint directory before serving it: its files (`check_model_dir`), a
    supported config, and every tensor the runtime loads present with the shape the config
    implies (read from the safetensors headers). A missing chat template is reported, not
    refused: such a model serves completions, and chat requests are refused.

    Raises:
        ModelError: naming the file, the tensor and the shape that do not fit.
    """
    files = check_model_dir(model_dir)
    try:
        cfg = ModelConfig.from_dir(model_dir)
    except (KeyError, ValueError) as e:
        raise ModelError(f"{model_dir / 'config.json'}: {e} (supported model types: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)})") from None
    shapes: dict[str, list[int]] = {}
    for weights in files.weights:
        shapes.update(_header_shapes(weights))
    problems = []
    for name, want in expected_tensors(cfg).items():
        got = shapes.get(name)
        if got is None:
            problems.append(f"`{name}` is missing")
        elif got != want:
            problems.append(f"`{name}` has shape {got}, the config implies {want}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ModelError(f"{model_dir}: the weights do not fit config.json: "
                         f"{'; '.join(problems[:3])}{more}")
    template = None
    if (model_dir / TOKENIZER_CONFIG).is_file():
        template = read_json_object(model_dir / TOKENIZER_CONFIG, "tokenizer config").get(
            "chat_template")
    if not isinstance(template, str):
        say(f"{model_dir}: no chat template: it serves completions; chat requests are refused")
    return cfg


def expected_tensors(cfg: ModelConfig) -> dict[str, list[int]]:
    """The checkpoint tensors (HF names) the runtime loads, with their shapes."""
    h, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out: dict[str, list[int]] = {"model.embed_tokens.weight": [cfg.vocab_size, h],
                                 "model.norm.weight": [h]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [cfg.vocab_size, h]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
                p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
                p + "mlp.gate_proj.weight": [ff, h], p + "mlp.up_proj.weight": [ff, h],
                p + "mlp.down_proj.weight": [h, ff]}
        if cfg.attention_bias:
            out |= {p + "self_attn.q_proj.bias": [q], p + "self_attn.k_proj.bias": [kv],
                    p + "self_attn.v_proj.bias": [kv]}
    return out


def _header_shapes(path: Path) -> dict[str, list[int]]:
    """name -> shape of every tensor in one safetensors file (its JSON header only)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header: dict[str, Any] = json.loads(f.read(length))
    return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def _identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    source = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    return {"format": _IMPORT_FORMAT, "source": str(path), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "key": hashlib.sha256(source.encode()).hexdigest()[:12]}
