"""Typed reads of JSON request fields. A field of the wrong type is a 400 naming it.

Types are checked here; ranges are the router's job (it names the field and the limit), except
that integers must fit the protobuf field they travel in (int32 / int64), which the router
cannot report.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import APIError, invalid

INT32 = 32
INT64 = 64


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def wrong_type(name: str, expected: str, value: Any) -> APIError:
    return invalid(name, f"{name} must be {expected}, got {_type_name(value)}")


def check_text(name: str, value: str) -> str:
    """`value` encodes as UTF-8 (JSON may carry lone surrogates like "\\ud800"; gRPC cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(name, f"{name} contains an unpaired UTF-16 surrogate") from None
    return value


def as_int(name: str, value: Any, bits: int = INT32) -> int:
    """An integer (an integral float like 2.0 is accepted, as OpenAI's API does)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(name, "an integer", value)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if not lo <= value <= hi:
        raise invalid(name, f"{name} = {value} does not fit a {bits}-bit integer "
                            f"[{lo}, {hi}]")
    return value


class Fields:
    """Reads the fields of one JSON object; `prefix` names it in errors ("stream_options.")."""

    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix
        self.read: set[str] = set()  # the keys a parser asked for

    def refuse_unknown(self, ignored: frozenset[str] = frozenset()) -> None:
        """A 400 naming every key of the body that no parser read and `ignored` does not
        list: a field this server does not know would otherwise change nothing, silently
        (vLLM's `guided_json`, `min_tokens`, ...)."""
        unknown = sorted(k for k in self.body if k not in self.read and k not in ignored)
        if unknown:
            names = ", ".join(self._name(k) for k in unknown)
            raise invalid(self._name(unknown[0]),
                          f"unknown field{'s' if len(unknown) > 1 else ''} {names}: not "
                          "supported by this server (docs/GATEWAY.md lists the fields it "
                          "reads and those it ignores)")

    def _name(self, key: str) -> str:
        return self.prefix + key

    def raw(self, key: str) -> Any:
        """The value as sent; a missing key and an explicit null both read as None (unset)."""
        self.read.add(key)
        return self.body.get(key)

    def string(self, key: str) -> str | None:
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise wrong_type(self._name(key), "a string", value)
        return check_text(self._name(key), value)

    def boolean(self, key: str) -> bool | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, bool):
            raise wrong_type(self._name(key), "a boolean", value)
        return value

    def integer(self, key: str, bits: int = INT32) -> int | None:
        value = self.raw(key)
        return None if value is None else as_int(self._name(key), value, bits)

    def number(self, key: str) -> float | None:
        value = self.raw(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong_type(self._name(key), "a number", value)
        return float(value)

    def obj(self, key: str) -> Fields | None:
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise wrong_type(self._name(key), "an object", value)
        return Fields(value, self._name(key) + ".")

    def array(self, key: str) -> list[Any] | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, list):
            raise wrong_type(self._name(key), "an array", value)
        return value

    def strings(self, key: str) -> tuple[str, ...] | None:
        """A string or an array of strings (OpenAI's `stop`)."""
        value = self.raw(key)
        if value is None:
            return None
        if isinstance(value, str):
            return (check_text(self._name(key), value),)
        if not isinstance(value, list):
            raise wrong_type(self._name(key), "a string or an array of strings", value)
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise wrong_type(f"{self._name(key)}[{i}]", "a string", item)
            check_text(f"{self._name(key)}[{i}]", item)
        return tuple(value)

    def integers(self, key: str, bits: int = INT64) -> tuple[int, ...] | None:
        value = self.array(key)
        if value is None:
            return None
        return tuple(as_int(f"{self._name(key)}[{i}]", v, bits) for i, v in enumerate(value))
