"""The router's audit log: one JSON line per `Generate` call, on the `stagemesh.audit` logger.

Fields: `time` (UTC, ISO 8601, when the call ended), `request_id`, `key_id` (`sha256:` and
the first 12 hex digits of the API key's hash; the key itself never), `client` (the peer
address gRPC reports), `model`, `prompt_tokens`, `completion_tokens`, `finish_reasons` (one
per choice), `status` (the gRPC status name the call ended with: OK, INVALID_ARGUMENT,
CANCELLED when the client went away, ...) and `duration_ms`. Prompt and output text only
with `content` (off by default: they are the users' data). The lines go to stderr by
themselves, without the process's log prefix, so a collector can parse them as JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

log = logging.getLogger("stagemesh.audit")


def key_id(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The id of the API key in `authorization: Bearer <key>` metadata ("" without one)."""
    for name, value in metadata or ():
        if name == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            digest = hashlib.sha256(value.removeprefix("Bearer ").encode()).hexdigest()
            return f"sha256:{digest[:12]}"
    return ""


@dataclass
class AuditRecord:
    """One call's line, filled in while it runs."""

    client: str
    key_id: str
    model: str = ""
    request_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice -> reason
    status: str = "OK"
    prompt: str = ""
    output: dict[int, str] = field(default_factory=dict)  # choice -> text (content only)
    started: float = field(default_factory=time.monotonic)

    def line(self, content: bool) -> str:
        entry: dict[str, object] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "request_id": self.request_id, "key_id": self.key_id, "client": self.client,
            "model": self.model, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reasons": [self.finish_reasons[i] for i in sorted(self.finish_reasons)],
            "status": self.status,
            "duration_ms": round((time.monotonic() - self.started) * 1e3, 1)}
        if content:
            entry["prompt"] = self.prompt
            entry["output"] = [self.output[i] for i in sorted(self.output)]
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


class AuditLog:
    """Writes `AuditRecord`s when `enabled` (with prompt and output text when `content`)."""

    def __init__(self, enabled: bool = True, content: bool = False) -> None:
        self.enabled = enabled
        self.content = content
        if enabled and not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False

    def emit(self, record: AuditRecord) -> None:
        if self.enabled:
            log.info(record.line(self.content))
