"""Structured output on the last stage: the sampler under llguidance's masks, over random
logits (any token could win) and many seeds, always yields an output the constraint
accepts, checked by a validator nobody here wrote (jsonschema, re), and ends it with EOS
(any JSON object, which random logits can nest without end, is left to the mesh tests,
where the model closes it); a
sequence resent with earlier outputs (preemption, a stage restart) gets the mask of one
that was never interrupted."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from foundation.sampling_params import SamplingParams
from foundation.structured_output import ConstraintKind, StructuredOutput
from foundation.tokenizer import ModelTokenizer
from stage_worker.held_seqs import HeldSeq
from stage_worker.sampling import Sampler
from stage_worker.step_sampling import sample_step
from stage_worker.structured import GrammarMasks
from tests.default_model import default_model_dir

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    "owner": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/code"}]}},
    "required": ["name", "age", "kind", "tags", "owner"], "additionalProperties": False,
    "$defs": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}}
# [0-9], not \d: llguidance's \d is Unicode's (Rust regex), of a newer Unicode than re's.
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["red", "green", "blue", "not a colour"]
MAX_STEPS = 160


def _model_dir() -> Path:
    """The default model's; on the GPU machine, which cannot fetch it, $STAGEMESH_GPU_MODEL's
    (a checkpoint with the default model's tokenizer, `benchmarks.make_random_model`)."""
    path = os.environ.get("STAGEMESH_GPU_MODEL")
    return Path(path) if path else default_model_dir()


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer.from_dir(_model_dir())


@pytest.fixture(scope="module")
def masks(tok: ModelTokenizer) -> GrammarMasks:
    return GrammarMasks(_model_dir(), tok.vocab_size)


def generate(masks: GrammarMasks, tok: ModelTokenizer, params: SamplingParams,
             seeds: range, device: str = "cpu") -> list[str]:
    """One output per seed, all sequences sampled together, step by step over random
    logits, until each samples EOS (the test fails if one has not within MAX_STEPS)."""
    seqs = [HeldSeq(i, [], [1], 1, 0, params) for i in range(len(seeds))]
    done: dict[int, list[int]] = {}
    gen = torch.Generator(device=device).manual_seed(seeds.start)
    sampler = Sampler()
    eos = set(tok.special.eos_ids)
    for _ in range(MAX_STEPS):
        live = [s for s in seqs if s.seq_id not in done]
        if not live:
            break
        logits = torch.randn(len(live), tok.vocab_size, generator=gen, device=device) * 4
        ids, _ = sample_step(sampler, logits, live, tok.vocab_size, masks).resolve()
        for seq, token in zip(live, ids, strict=True):
            if token in eos:
                done[seq.seq_id] = seq.output_ids
            else:
                seq.output_ids.append(token)
                seq.num_outputs += 1
    assert len(done) == len(seqs), f"{len(seqs) - len(done)} outputs did not end"
    return [tok.tokenizer.decode(done[s.seq_id]) for s in seqs]


def test_sampled_json_always_validates_against_the_schema(masks: GrammarMasks,
                                                          tok: ModelTokenizer) -> None:
    params = SamplingParams(temperature=1.0, structured=StructuredOutput(
        ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    outputs = generate(masks, tok, params, range(16))
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(outputs)) > 12  # random logits: the outputs differ


@pytest.mark.gpu
def test_masks_on_cuda(masks: GrammarMasks, tok: ModelTokenizer) -> None:
    """The masks uploaded to the GPU and applied there (the stage's path on CUDA)."""
    params = SamplingParams(temperature=1.0, structured=StructuredOutput(
        ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    outputs = generate(masks, tok, params, range(16), "cuda")
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(outputs)) > 12  # random logits: the outputs differ


@pytest.mark.parametrize(("structured", "check"), [
    (StructuredOutput(ConstraintKind.REGEX, PHONE), lambda t: re.fullmatch(PHONE, t)),
    (StructuredOutput.choice(CHOICES), lambda t: t in CHOICES),
    (StructuredOutput(ConstraintKind.GRAMMAR,
                      'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'),
     lambda t: re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", t)),
])
def test_regex_choice_and_grammar_outputs_match(masks: GrammarMasks, tok: ModelTokenizer,
                                                       structured: StructuredOutput,
                                                       check: object) -> None:
    params = SamplingParams(temperature=1.0, structured=structured)
    for text in generate(masks, tok, params, range(6)):
        assert check(text), text  # type: ignore[operator]


def test_a_resent_sequence_gets_the_mask_of_an_uninterrupted_one(masks: GrammarMasks,
                                                                 tok: ModelTokenizer) -> None:
    params = SamplingParams(temperature=0.0, structured=StructuredOutput(
        ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    prefix = tok.encode('{"name": "Rex", "age": 4', add_special_tokens=False)
    walked = HeldSeq(0, [], [1], 1, 0, params)
    for token in prefix:  # one token per step, as a running sequence is fed
        masks.masks([walked], [params])
        walked.output_ids.append(token)
    resent = HeldSeq(1, [], [1, *prefix], 1, len(prefix), params, list(prefix))
    got = masks.masks([walked, resent], [params, params])
    assert got is not None
    rows, bitmask = got
    assert rows == [0, 1] and torch.equal(bitmask[0], bitmask[1])
    assert not walked.grammar.is_error() and resent.grammar_consumed == len(prefix)


def test_a_complete_output_allows_only_the_end_of_sequence(masks: GrammarMasks,
                                                           tok: ModelTokenizer) -> None:
    params = SamplingParams(structured=StructuredOutput.choice(["yes"]))
    seq = HeldSeq(0, [], [1], 1, 1, params, tok.encode("yes", add_special_tokens=False))
    got = masks.masks([seq, HeldSeq(1, [], [1], 1, 0, None)], [params, SamplingParams()])
    assert got is not None
    rows, bitmask = got
    assert rows == [0]  # the unconstrained row gets no mask
    bits = ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    allowed = set(bits.nonzero().flatten().tolist())
    assert allowed and allowed <= set(tok.special.eos_ids)


def test_bad_constraints_name_the_problem() -> None:
    from foundation.sampling_params import SamplingParamsError

    cases = [
        (StructuredOutput(ConstraintKind.JSON_SCHEMA, '{"type": "objekt"}'),
         "structured_output.json_schema", "objekt"),
        (StructuredOutput(ConstraintKind.JSON_SCHEMA, "{"), "structured_output.json_schema",
         "not JSON"),
        (StructuredOutput(ConstraintKind.REGEX, "[a-"), "structured_output.regex",
         "unclosed character class"),
        (StructuredOutput(ConstraintKind.GRAMMAR, "root ::= missing"),
         "structured_output.grammar", "missing"),
        (StructuredOutput(ConstraintKind.CHOICE, "[]"), "structured_output.choice", "1 to"),
        (StructuredOutput(ConstraintKind.REGEX, "a" * 70_000), "structured_output.regex",
         "at most 65536"),
    ]
    for structured, field, words in cases:
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(structured=structured).validate(49152, 20)
        assert err.value.field == field and words in err.value.message, err.value.message
    with pytest.raises(SamplingParamsError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured=StructuredOutput(
            ConstraintKind.JSON_OBJECT)).validate(49152, 20)
