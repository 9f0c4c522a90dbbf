"""llguidance against xgrammar for structured output, on the default model's tokenizer.

For each constraint (JSON schemas of growing reach, a regex, a choice, an EBNF grammar) and
each engine: whether the engine accepts it, the time to compile it for one request (no
cache: each request brings its own schema), and the time to compute one token's mask
while a valid output is fed token by token (the per-step cost on the last stage), plus
whether every token of that output was allowed, and which invalid outputs the engine let
through (each should be refused somewhere along its tokens). CPU only; one thread per
engine. xgrammar is not a stagemesh dependency: install it beside to compare (the figures
in docs/BENCHMARKS.md used xgrammar 0.2.9 and llguidance 1.9.1).

    python -m benchmarks.grammar_engines --out grammar_engines.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import git_revision, print_table, write_json

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                             "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
             "minItems": 1, "maxItems": 4},
    "kind": {"enum": ["book", "film", "song"]},
    "owner": {"$ref": "#/$defs/person"},
    "score": {"type": "number"},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["id", "tags", "kind", "owner", "score", "note"],
    "additionalProperties": False, "$defs": {"person": PERSON}}
PATTERNED = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "email": {"type": "string", "format": "email"},
    "day": {"type": "string", "format": "date"},
    "count": {"type": "integer", "exclusiveMinimum": 0, "multipleOf": 5},
    "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
             "items": False}},
    "required": ["code", "email", "day", "count", "pair"], "additionalProperties": False}
ONE_OF = {"oneOf": [{"type": "object", "properties": {"cat": {"const": "meow"}},
                     "required": ["cat"], "additionalProperties": False},
                    {"type": "object", "properties": {"dog": {"const": "woof"}},
                     "required": ["dog"], "additionalProperties": False}]}

# Outputs a correct engine must refuse somewhere along the way (case -> [(what, output)]).
INVALID: dict[str, list[tuple[str, str]]] = {
    "schema: person": [("extra property", '{"name": "A", "age": 3, "x": 1}'),
                       ("missing required", '{"name": "A"}')],
    "schema: nested, $ref, enum, anyOf": [
        ("maximum", '{"id": 10000, '), ("enum", '{"id": 1, "tags": ["a"], "kind": "poem"'),
        ("maxItems", '{"id": 1, "tags": ["a", "b", "c", "d", "e"]')],
    "schema: pattern, format, prefixItems": [
        ("pattern", '{"code": "abc-1234"'), ("format email", '{"code": "ABC-1234", '
         '"email": "not an email"'),
        ("format date", '{"code": "ABC-1234", "email": "a@b.org", "day": "1843-13-45"'),
        ("multipleOf", '{"code": "ABC-1234", "email": "a@b.org", "day": "1843-07-10", '
         '"count": 7,'),
        ("exclusiveMinimum", '{"code": "ABC-1234", "email": "a@b.org", "day": '
         '"1843-07-10", "count": 0,')],
    "schema: oneOf, const": [("const", '{"dog": "meow"}')],
    "regex": [("regex", "555-1234-567")],
    "choice": [("choice", "maybe")],
}

# (name, kind, spec, a valid output)
CASES: list[tuple[str, str, Any, str]] = [
    ("json object", "json_object", None, '{"answer": [1, 2, {"b": null}], "ok": true}'),
    ("schema: person", "json_schema", PERSON, '{"name": "Ada Lovelace", "age": 36}'),
    ("schema: nested, $ref, enum, anyOf", "json_schema", NESTED,
     '{"id": 42, "tags": ["math", "poetry"], "kind": "book", "owner": {"name": "Ada", '
     '"age": 36}, "score": 9.5, "note": null}'),
    ("schema: pattern, format, prefixItems", "json_schema", PATTERNED,
     '{"code": "ABC-1234", "email": "ada@example.org", "day": "1843-07-10", "count": 15, '
     '"pair": ["x", 3]}'),
    ("schema: oneOf, const", "json_schema", ONE_OF, '{"dog": "woof"}'),
    ("regex", "regex", r"\d{3}-\d{3}-\d{4}", "555-123-4567"),
    ("choice", "choice", ["positive", "negative", "neutral"], "negative"),
    ("grammar (EBNF)", "grammar",
     'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"',
     "(12+3)+45"),
]


class Engine:
    name: str

    def compile(self, kind: str, spec: Any) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...


class Llguidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import llguidance
        import llguidance.torch

        self.ll = llguidance
        self.fill_mask = llguidance.torch.fill_next_token_bitmask
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)

    def compile(self, kind: str, spec: Any) -> Any:
        m = self.ll.LLMatcher
        if kind == "json_object":
            grammar = m.grammar_from_json_schema('{"type": "object"}')
        elif kind == "json_schema":
            grammar = m.grammar_from_json_schema(json.dumps(spec))
        elif kind == "regex":
            grammar = m.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = m.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec))
        else:
            from llguidance.gbnf_to_lark import any_to_lark
            grammar = m.grammar_from_lark(any_to_lark(spec))
        matcher = m(self.tok, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self.fill_mask(matcher, bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class Xgrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer_dir: Path, vocab: int) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            AutoTokenizer.from_pretrained(tokenizer_dir), vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: Any) -> Any:
        c = self.compiler
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in spec))
        return c.compile_grammar(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Median ms of `reps` calls, and the last result."""
    out, times = None, []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def allows(engine: Engine, compiled: Any, ids: list[int], vocab: int,
           mask_ms: list[float] | None = None) -> bool:
    """Whether every token of `ids` is in the mask in turn and accepted."""
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    matcher = engine.matcher(compiled)
    for token in ids:
        t0 = time.perf_counter()
        engine.fill(matcher, bitmask)
        if mask_ms is not None:
            mask_ms.append((time.perf_counter() - t0) * 1e3)
        word = int(bitmask[0, token // 32])
        if not (word >> (token % 32)) & 1 or not engine.accept(matcher, token):
            return False
    return True


def run_case(engine: Engine, kind: str, spec: Any, name: str, ids: list[int],
             vocab: int, encode: Callable[[str], list[int]]) -> dict[str, Any]:
    try:
        compile_ms, compiled = timed(lambda: engine.compile(kind, spec), 5)
    except Exception as e:  # an engine refusing a schema is a finding, not a crash
        return {"accepted": False, "error": f"{type(e).__name__}: {e}"[:200]}
    mask_ms: list[float] = []
    allowed = allows(engine, compiled, ids, vocab, mask_ms)
    let_through = [what for what, bad in INVALID.get(name, [])
                   if allows(engine, compiled, encode(bad), vocab)]
    return {"invalid_let_through": ",".join(let_through) or "-", "accepted": True,
            "compile_ms": compile_ms,
            "mask_us_mean": statistics.fmean(mask_ms) * 1e3,
            "mask_us_p99": sorted(mask_ms)[int(0.99 * (len(mask_ms) - 1))] * 1e3,
            "tokens": len(ids), "output_allowed": allowed}


def main() -> None:
    from tokenizers import Tokenizer

    from foundation.modelstore import fetch_default_model

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=None, help="default: the default model")
    ap.add_argument("--out", type=Path, default=Path("grammar_engines.json"))
    args = ap.parse_args()
    model = args.model or fetch_default_model()
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    eos = config.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else eos
    torch.set_num_threads(1)
    engines: list[Engine] = [Llguidance(tokenizer.to_str(), vocab, eos)]
    try:  # not a dependency of stagemesh: compared where installed
        engines.append(Xgrammar(model, vocab))
    except ImportError:
        print("xgrammar is not installed: llguidance alone")
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    rows = []
    for name, kind, spec, valid in CASES:
        ids = tokenizer.encode(valid, add_special_tokens=False).ids
        for engine in engines:
            row = {"case": name, "engine": engine.name,
                   **run_case(engine, kind, spec, name, ids, vocab, encode)}
            rows.append(row)
            print(row, flush=True)
    write_json(args.out, {"model": str(model.name), "vocab": vocab,
                          "revision": git_revision()}, rows)
    print_table([{k: v for k, v in r.items() if k != "error"} for r in rows])


if __name__ == "__main__":
    main()
