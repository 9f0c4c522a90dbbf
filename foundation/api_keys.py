"""API keys shared by the gateway (HTTP `Authorization: Bearer`) and the router (gRPC
`authorization` metadata): loading them, and checking a presented key in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path


def load_api_keys(flags: Iterable[str], env_value: str | None, key_file: Path | None
                  ) -> frozenset[str]:
    """Every key from the flags, the comma-separated environment value and the file (one key
    per line; blank lines and lines starting with '#' are skipped). Empty: auth is off."""
    keys = {k.strip() for k in flags}
    if env_value:
        keys |= {k.strip() for k in env_value.split(",")}
    if key_file is not None:
        for line in key_file.read_text("utf-8").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                keys.add(line.strip())
    return frozenset(k for k in keys if k)


class ApiKeys:
    """Accepted keys, kept as SHA-256 digests. `matches` compares against every digest with
    `hmac.compare_digest` and no early exit, so its time does not depend on the key."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in sorted(set(keys))]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def matches(self, key: str) -> bool:
        given = hashlib.sha256(key.encode()).digest()
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(given, digest)
        return ok

    def authorizes(self, header: str) -> bool:
        """True for an `Authorization` value "Bearer <one of the keys>"."""
        scheme, _, token = header.strip().partition(" ")
        return self.matches(token.strip()) and scheme.lower() == "bearer"
