"""Tokenizer and chat template of a model directory, without transformers.

`tokenizer.json` goes through the `tokenizers` library; the chat template is the jinja2
string in `tokenizer_config.json`, rendered in a sandbox the way HF transformers renders it
(trim_blocks, lstrip_blocks, `raise_exception`, `tojson`). Imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The template refused the messages (e.g. roles out of order), or there is none."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@dataclass(frozen=True)
class SpecialTokens:
    bos: str | None
    eos: str | None
    eos_ids: tuple[int, ...]


class ModelTokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any],
                 eos_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.add_bos = bool(config.get("add_bos_token", False))
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        ids = list(eos_ids)
        if eos is not None and (eos_id := tokenizer.token_to_id(eos)) is not None:
            ids.append(eos_id)
        self.special = SpecialTokens(bos, eos, tuple(dict.fromkeys(ids)))
        template = config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self._template = env.from_string(template) if isinstance(template, str) else None

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelTokenizer:
        config: dict[str, Any] = {}
        if (model_dir / "tokenizer_config.json").exists():
            config = json.loads((model_dir / "tokenizer_config.json").read_text("utf-8"))
        eos_ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if (model_dir / name).exists():
                eos = json.loads((model_dir / name).read_text("utf-8")).get("eos_token_id")
                eos_ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return cls(Tokenizer.from_file(str(model_dir / "tokenizer.json")), config, eos_ids)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def chat_template_text(self) -> str | None:
        """The chat template's source (what the router's tool-call parser is picked by)."""
        template = self.config.get("chat_template")
        return template if isinstance(template, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text prompt -> ids; a BOS is prepended when the model's config asks.

        The ids of `Tokenizer.encode`, through `encode_batch_fast`, which skips the
        offsets and releases the interpreter lock while it runs: a thread that tokenizes
        a long prompt leaves the process's other threads running."""
        ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        bos_id = self.tokenizer.token_to_id(self.special.bos) if self.special.bos else None
        if add_special_tokens and self.add_bos and bos_id is not None \
                and (not ids or ids[0] != bos_id):
            ids.insert(0, bos_id)
        return ids

    def render_chat(self, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        """Messages through the chat template; `tools` (HF's convention: {"type":
        "function", "function": {name, description, parameters}}) are passed as the
        template's `tools` when given. Raises ChatTemplateError."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt")
        extra = {"tools": list(tools)} if tools else {}
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.special.bos or "", eos_token=self.special.eos or "", **extra,
            )
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        # The template writes its own special tokens: encode without adding more.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def _token_text(value: Any) -> str | None:
    """tokenizer_config token entries are strings or {"content": ...} objects."""
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return value if isinstance(value, str) else None
