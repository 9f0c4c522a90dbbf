"""One-time import of a GGUF checkpoint into Hugging Face layout (fp32 safetensors).

transformers reads the GGUF and dequantizes it; this module writes what the rest of stagemesh
reads without transformers: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with the chat template inline) and generation_config.json.

Needs the `gguf` extra (transformers, gguf, accelerate); imported lazily, so the rest of the
model store works without them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.modelstore.errors import ModelError
from foundation.modelstore.layout import (
    CONFIG,
    SINGLE_WEIGHTS,
    TOKENIZER,
    TOKENIZER_CONFIG,
)
from foundation.modelstore.progress import say

GENERATION_CONFIG = "generation_config.json"
# Keys of a transformers config that describe how it was loaded, not the model.
_LOAD_ONLY_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path",
                          "_commit_hash", "transformers_version")
# Keys transformers 5 puts in tokenizer_config.json that older readers do not know.
_LOAD_ONLY_TOKENIZER_KEYS = ("is_local", "local_files_only", "backend", "tokenizer_file")
# Text whose token ids must come out the same from tokenizer.json and the GGUF tokenizer.
_PROBE_TEXT = "Hello world! Ünïcödé  spaces\n\tand 12345 <|im_end|> done"


@dataclass(frozen=True)
class ImportSummary:
    n_tensors: int  # tensors written (a tied lm_head is not among them)
    n_params: int
    seconds: float


def import_gguf(gguf_path: Path, out_dir: Path) -> ImportSummary:
    """Writes the GGUF model at `gguf_path` into the empty directory `out_dir` in HF layout.

    Weights are stored in float32: they are the exact dequantized values, which bf16 would
    round. A tied output head is stored once (as the embedding), as transformers does.
    """
    start = time.monotonic()
    torch, transformers = _import_backend()
    say("importing GGUF → safetensors (fp32) with transformers…")
    name, parent = gguf_path.name, str(gguf_path.parent)
    tokenizer = transformers.AutoTokenizer.from_pretrained(parent, gguf_file=name)
    dtype_kw = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        parent, gguf_file=name, **{dtype_kw: torch.float32}
    )
    config = hf_config(model.config.to_diff_dict(), type(model).__name__)
    tensors = {
        key: value.detach().to(torch.float32).contiguous()
        for key, value in model.state_dict().items()
        if not (config.get("tie_word_embeddings") and key == "lm_head.weight")
    }
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / SINGLE_WEIGHTS), metadata={"format": "pt"})
    _write_json(out_dir / CONFIG, config)
    _write_json(out_dir / GENERATION_CONFIG, _generation_config(config))
    _save_tokenizer(tokenizer, out_dir, config)
    _check_tokenizer_roundtrip(tokenizer, out_dir)
    return ImportSummary(
        n_tensors=len(tensors),
        n_params=sum(t.numel() for t in tensors.values()),
        seconds=time.monotonic() - start,
    )


def hf_config(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The config.json to write, readable by transformers 4.x and 5.x and by our own loader.

    transformers 5 keeps RoPE settings in `rope_parameters`; 4.x reads `rope_theta` and
    `rope_scaling` (null for plain RoPE). All three are written.
    """
    config = {k: v for k, v in raw.items() if k not in _LOAD_ONLY_CONFIG_KEYS}
    config["architectures"] = [architecture]
    config["torch_dtype"] = config["dtype"] = "float32"
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        config["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" \
            else scaling
    return dict(sorted(config.items()))


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


def _save_tokenizer(tokenizer: Any, out_dir: Path, config: dict[str, Any]) -> None:
    """tokenizer.json plus a self-contained tokenizer_config.json (chat template inline)."""
    tokenizer.save_pretrained(str(out_dir))
    saved = json.loads((out_dir / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    # transformers 5 writes the template to its own file; readers of tokenizer_config.json
    # (our router, transformers 4.x) expect it inline.
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    (out_dir / "special_tokens_map.json").unlink(missing_ok=True)
    tokenizer_config = {k: v for k, v in saved.items() if k not in _LOAD_ONLY_TOKENIZER_KEYS}
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    tokenizer_config.update(
        # A class every transformers version loads from tokenizer.json as is.
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=tokenizer.chat_template,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        unk_token=tokenizer.unk_token,
        # What encoding does, observed rather than read from a version-dependent attribute.
        add_bos_token=bool(probe) and probe[0] == tokenizer.bos_token_id,
        add_eos_token=bool(probe) and probe[-1] == tokenizer.eos_token_id,
        clean_up_tokenization_spaces=False,
        model_max_length=config.get("max_position_embeddings", saved.get("model_max_length")),
    )
    if not isinstance(tokenizer_config["chat_template"], str):
        raise ModelError("the GGUF file carries no chat template (tokenizer.chat_template)")
    _write_json(out_dir / TOKENIZER_CONFIG, dict(sorted(tokenizer_config.items())))


def _check_tokenizer_roundtrip(tokenizer: Any, out_dir: Path) -> None:
    """The written tokenizer.json must encode like the GGUF tokenizer, or the import is wrong."""
    from tokenizers import Tokenizer

    written = Tokenizer.from_file(str(out_dir / TOKENIZER))
    got = written.encode(_PROBE_TEXT, add_special_tokens=False).ids
    want = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if got != want:
        raise ModelError(
            f"import check failed: {out_dir / TOKENIZER} encodes {_PROBE_TEXT!r} as {got}, "
            f"the GGUF tokenizer as {want}; this transformers version "
            f"may convert GGUF tokenizers differently"
        )


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _version(text: str) -> tuple[int, int]:
    major, minor = [*text.split("."), "0"][:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _import_backend() -> tuple[Any, Any]:
    """(torch, transformers), or a ModelError saying which extra to install."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF; fail here, clearly)
        import torch
        import transformers
    except ImportError as exc:
        raise ModelError(
            f"importing the default model needs transformers, gguf and accelerate ({exc}): "
            "run `pip install 'stagemesh[gguf]'` (or scripts/setup.sh dev,gguf)"
        ) from None
    return torch, transformers
