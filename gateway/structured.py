"""Structured output in OpenAI's and vLLM's request shapes -> the router's constraint.

OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema":
{"name", "schema", "strict", "description"}}. vLLM (in the body, `extra_body` for the openai
client): `guided_json` (a schema, as an object or JSON text), `guided_regex`,
`guided_choice` (an array of strings), `guided_grammar` (EBNF or Lark). At most one may
constrain a request. Only the shapes are checked here; the router compiles the constraint
and answers a bad schema, regex or grammar with INVALID_ARGUMENT naming the problem.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import invalid
from gateway.fields import Fields, wrong_type

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output(f: Fields) -> tuple[str, tuple[str, Any]] | None:
    """(the field that carried it, `router.client.set_structured_output`'s (kind, spec)) for
    the request, or None."""
    found: list[tuple[str, tuple[str, Any]]] = []
    fmt = f.obj("response_format")
    if fmt is not None:
        kind = fmt.string("type")
        if kind == "json_object":
            found.append(("response_format", ("json_object", None)))
        elif kind == "json_schema":
            found.append(("response_format", ("json_schema", _json_schema(fmt))))
        elif kind not in (None, "text"):
            raise invalid("response_format.type", "response_format.type must be text, "
                                                  f"json_object or json_schema, got {kind!r}")
        fmt.refuse_unknown()
    schema = f.raw("guided_json")
    if schema is not None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise invalid("guided_json", f"guided_json is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise wrong_type("guided_json", "a JSON schema (an object)", schema)
        found.append(("guided_json", ("json_schema", schema)))
    if (regex := f.string("guided_regex")) is not None:
        found.append(("guided_regex", ("regex", regex)))
    choices = f.raw("guided_choice")
    if choices is not None:
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise wrong_type("guided_choice", "an array of strings", choices)
        found.append(("guided_choice", ("choice", choices)))
    if (grammar := f.string("guided_grammar")) is not None:
        found.append(("guided_grammar", ("grammar", grammar)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise invalid(found[1][0], f"only one structured output constraint may be given; got "
                                   f"{names}")
    return found[0] if found else None


def _json_schema(fmt: Fields) -> dict[str, Any]:
    """OpenAI's response_format.json_schema: its `schema` (an object); `name`, `strict` and
    `description` are read for their types only (the schema is always enforced)."""
    spec = fmt.obj("json_schema")
    if spec is None:
        raise invalid("response_format.json_schema",
                      "response_format.json_schema is required when type is json_schema")
    spec.string("name")
    spec.string("description")
    spec.boolean("strict")
    schema = spec.raw("schema")
    spec.refuse_unknown()
    if schema is None:
        raise invalid("response_format.json_schema.schema",
                      "response_format.json_schema.schema is required")
    if not isinstance(schema, dict):
        raise wrong_type("response_format.json_schema.schema", "an object", schema)
    return schema
