"""Structured output: a constraint on what a sequence may generate (JSON, a JSON schema, a
regex, one of some strings, a grammar), and its llguidance grammar.

Shared by the router (which validates a request's constraint before admitting it) and the
last stage (which keeps one matcher per constrained sequence and masks its logits each
step, `stage_worker.structured`). Torch-free. The engine is llguidance: against xgrammar on
the default model's tokenizer (`benchmarks.grammar_engines`) it enforced every schema
keyword tried (xgrammar ignores `multipleOf` with a range, with only a warning, so an output
could break the schema) and compiles a schema in about 1 ms instead of 6-30 ms, at the
price of slower masks (30-140 us per token against 5-13 us), which the last stage computes
for all constrained sequences of a step in parallel threads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

# The largest constraint text a request may carry (a schema's JSON, a regex, a grammar).
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024
# JSON output with the usual separators and no free whitespace between tokens: a small
# model allowed any whitespace can emit it forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintKind(StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # spec: the schema, as JSON text
    REGEX = "regex"  # spec: the pattern (the whole output must match)
    CHOICE = "choice"  # spec: a JSON array of the allowed outputs
    GRAMMAR = "grammar"  # spec: a grammar in EBNF (GBNF, as llama.cpp and vLLM) or Lark


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled; the message says why. `field` names the request
    field (as the API spells it); mapped at the edge to INVALID_ARGUMENT/400."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must be. `spec` as `ConstraintKind` describes (empty for
    json_object). The sequence ends (EOS) when the constraint is complete."""

    kind: ConstraintKind
    spec: str = ""

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        return cls(ConstraintKind.CHOICE, json.dumps(options))

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint.

        Raises StructuredOutputError for a spec that is not even well formed (not JSON,
        not a list of strings); `validate` finds the rest."""
        import llguidance

        matcher = llguidance.LLMatcher
        kind, spec = self.kind, self.spec
        field = f"structured_output.{kind.value}"
        if len(spec.encode()) > MAX_SPEC_BYTES:
            raise StructuredOutputError(field, f"{field} is {len(spec.encode())} bytes; at most "
                                               f"{MAX_SPEC_BYTES} are accepted")
        if kind is ConstraintKind.JSON_OBJECT:
            return matcher.grammar_from_json_schema('{"type": "object"}',
                                                    defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        if kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(spec)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(field, f"{field} is not JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise StructuredOutputError(field, f"{field} must be a JSON object (a schema), "
                                                   f"got {type(schema).__name__}")
            try:
                return matcher.grammar_from_json_schema(
                    schema, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
            except ValueError as e:
                raise StructuredOutputError(field, f"{field}: {e}") from None
        if kind is ConstraintKind.REGEX:
            return matcher.grammar_from_regex(spec)
        if kind is ConstraintKind.CHOICE:
            options = json.loads(spec)
            if (not isinstance(options, list) or not options or len(options) > MAX_CHOICES
                    or not all(isinstance(o, str) and o for o in options)):
                raise StructuredOutputError(
                    field, f"{field} must be 1 to {MAX_CHOICES} non-empty strings")
            # Lark string literals take JSON's escapes.
            return matcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return matcher.grammar_from_lark(any_to_lark(spec))
        except Exception as e:  # the converter raises several types on a bad grammar
            raise StructuredOutputError(field, f"{field}: {e}") from None

    def validate(self) -> str:
        """The grammar, checked by llguidance (without a tokenizer: what the text says).

        Raises StructuredOutputError naming the problem (an unsupported schema keyword, a
        regex or grammar syntax error, a grammar rule that is never defined, ...)."""
        import llguidance

        grammar = self.grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            field = f"structured_output.{self.kind.value}"
            raise StructuredOutputError(field, f"{field}: {error.strip()}")
        return grammar
