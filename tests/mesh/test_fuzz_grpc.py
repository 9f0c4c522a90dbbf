"""Property-based fuzzing of the public gRPC API (Hypothesis) against a real `stagemesh
serve` (null model, 2 stages): any GenerateRequest, however odd its fields (NaN and
infinite floats, huge or negative counts, out-of-vocabulary ids, empty or unknown roles,
stop strings of any length, and at most one of the API's other features: min_tokens,
logit_bias, structured output, tools, prompt truncation and log probabilities, beam
search), ends with OK or a client-error status whose message names what is wrong, never
UNKNOWN or INTERNAL and never a hang; and the mesh is idle after every call (no KV block
held on the router or any stage). The same requests sent several at once, some cancelled
by the client after a few responses and some with deadlines of a millisecond up, end as
the client made them end or as they would alone, and leave the mesh idle."""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from foundation.modelstore import DEFAULT_MODEL
from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from tests.default_model import default_model_dir
from tests.mesh.harness import Mesh, wait_idle

pytestmark = pytest.mark.slow

MODEL = DEFAULT_MODEL.name  # the served name (known without fetching the model)

CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
                 grpc.StatusCode.OUT_OF_RANGE}

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "seed", "max_tokens", "n", "logprobs", "stop", "stop_token_ids",
          "token_ids", "messages", "text", "model", "role", "prompt", "vocabulary", "request",
          "priority", "content", "chat", "input", "min_tokens", "logit_bias",
          "structured_output", "tool", "request_id", "truncate_prompt_tokens",
          "prompt_logprobs", "beam", "length_penalty", "early_stopping")


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    with Mesh("--model", str(default_model_dir()), "--stages", "2", "--model-impl", "null",
              "--num-blocks", "256", "--max-model-len", "128") as mesh:
        yield mesh


@pytest.fixture(scope="module")
def stub(mesh: Mesh) -> inference_pb2_grpc.InferenceServiceStub:
    return mesh.stub()


def _ending(mesh: Mesh, code: grpc.StatusCode) -> str:
    """After UNAVAILABLE, how the mesh's output ends once it exited (a request that takes it
    down is a bug whose cause is there); "" while it runs."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return ""
    with contextlib.suppress(subprocess.TimeoutExpired):
        mesh.proc.proc.wait(30)  # serve takes a moment to stop every process
    if mesh.proc.proc.poll() is None:
        return ""
    return f"\nthe mesh exited ({mesh.proc.proc.returncode}); its output ends:\n" + \
        mesh.proc.output[-6000:]


_wild_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
_wild_counts = st.integers(-(2**31), 2**31 - 1)
_text = st.text(max_size=40)


def _mix(valid: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value (so most requests run), one time in eight anything."""
    return st.integers(0, 7).flatmap(lambda i: wild if i == 0 else valid)


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=draw(_mix(st.sampled_from(["", MODEL]), st.text(max_size=12))))
    kind = draw(st.sampled_from(["text", "ids", "chat", "none"]))
    if kind == "text":
        req.text = draw(_text)
    elif kind == "ids":
        req.token_ids.ids.extend(draw(st.lists(
            _mix(st.integers(0, 49151), st.integers(-(2**62), 2**62)), max_size=12)))
    elif kind == "chat":
        role = _mix(st.sampled_from(["user", "system", "assistant"]), st.text(max_size=8))
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in draw(
            st.lists(st.tuples(role, _text), max_size=3)))
        if draw(st.booleans()):
            req.chat.add_generation_prompt = draw(st.booleans())
    valid = {"temperature": st.floats(0, 2, width=32),
             "top_p": st.floats(0, 1, width=32, exclude_min=True),
             "min_p": st.floats(0, 1, width=32),
             "repetition_penalty": st.floats(0.5, 2, width=32),
             "presence_penalty": st.floats(-2, 2, width=32),
             "frequency_penalty": st.floats(-2, 2, width=32)}
    for name, strategy in valid.items():
        if draw(st.booleans()):
            setattr(req.sampling, name, draw(_mix(strategy, _wild_floats)))
    if draw(st.booleans()):
        req.sampling.top_k = draw(_mix(st.integers(-1, 50), _wild_counts))
    if draw(st.booleans()):
        req.sampling.seed = draw(st.integers(-(2**63), 2**63 - 1))
    for name, strategy in (("max_tokens", st.integers(1, 24)), ("n", st.integers(1, 3)),
                           ("logprobs", st.integers(0, 5))):
        if draw(st.booleans()):
            setattr(req, name, draw(_mix(strategy, _wild_counts)))
    req.stop.extend(draw(st.lists(_mix(st.text(min_size=1, max_size=4),
                                       st.text(max_size=64)), max_size=3)))
    req.stop_token_ids.extend(draw(st.lists(
        _mix(st.integers(0, 49151), st.integers(-(2**62), 2**62)), max_size=3)))
    req.ignore_eos = draw(st.booleans())
    req.priority = draw(st.integers(-(2**31), 2**31 - 1))
    req.include_stop_str_in_output = draw(st.booleans())
    if draw(st.booleans()):
        req.skip_special_tokens = draw(st.booleans())
    req.request_id = draw(_mix(st.just(""), st.text(max_size=300)))
    # At most one of the API's other features a request, so that most requests still run.
    feature = draw(st.sampled_from([None] * 9 + list(_FEATURES)))
    if feature is not None:
        _FEATURES[feature](draw, req)
    return req


def _min_tokens(draw: st.DrawFn, req: pb.GenerateRequest) -> None:
    req.sampling.min_tokens = draw(_mix(st.integers(0, 24), _wild_counts))


def _logit_bias(draw: st.DrawFn, req: pb.GenerateRequest) -> None:
    req.sampling.logit_bias.update(draw(st.dictionaries(
        _mix(st.integers(0, 49151), st.integers(-(2**62), 2**62)),
        _mix(st.floats(-100, 100, width=32), _wild_floats), max_size=3)))


def _structured_output(draw: st.DrawFn, req: pb.GenerateRequest) -> None:
    req.sampling.structured_output.CopyFrom(draw(_structured()))


def _prompt_counts(draw: st.DrawFn, req: pb.GenerateRequest) -> None:
    for name, strategy in (("truncate_prompt_tokens", st.integers(1, 16)),
                           ("prompt_logprobs", st.integers(0, 5))):
        if draw(st.booleans()):
            setattr(req, name, draw(_mix(strategy, _wild_counts)))


def _tools(draw: st.DrawFn, req: pb.GenerateRequest) -> None:
    req.chat.tools.extend(draw(st.lists(st.builds(
        pb.Tool, name=_mix(st.sampled_from(["get_weather", "add"]), st.text(max_size=8)),
        description=st.text(max_size=12),
        parameters=_mix(st.sampled_from(["", '{"type": "object"}']), st.text(max_size=20))),
        min_size=1, max_size=2)))
    if draw(st.booleans()):
        if draw(st.booleans()):
            req.tool_choice.mode = draw(st.integers(0, 4))  # 4: no such mode
        else:
            req.tool_choice.function = draw(_mix(st.just(req.chat.tools[0].name),
                                                 st.text(max_size=8)))
    if draw(st.booleans()):
        req.parallel_tool_calls = draw(st.booleans())


def _beam_search(draw: st.DrawFn, req: pb.GenerateRequest) -> None:
    if draw(st.booleans()):  # beam search refuses sampling settings: often none
        req.ClearField("sampling")
        del req.stop[:], req.stop_token_ids[:]
        req.ClearField("logprobs")
    beam = req.beam_search
    beam.SetInParent()
    if draw(st.booleans()):
        beam.beam_width = draw(_mix(st.integers(1, 4), _wild_counts))
    if draw(st.booleans()):
        beam.length_penalty = draw(_mix(st.floats(-2, 2, width=32), _wild_floats))
    beam.early_stopping = draw(st.integers(0, 3))  # 3: no such value


_FEATURES = {"min_tokens": _min_tokens, "logit_bias": _logit_bias,
             "structured_output": _structured_output, "prompt_counts": _prompt_counts,
             "tools": _tools, "beam_search": _beam_search}


_SCHEMAS = ['{"type": "object"}', '{"type": "string", "maxLength": 3}', '{"enum": ["a", "b"]}',
            '{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}']


@st.composite
def _structured(draw: st.DrawFn) -> pb.StructuredOutput:
    out = pb.StructuredOutput()
    kind = draw(st.sampled_from(["json_object", "json_schema", "regex", "choice", "grammar"]))
    if kind == "json_object":
        out.json_object = draw(st.booleans())
    elif kind == "json_schema":
        out.json_schema = draw(_mix(st.sampled_from(_SCHEMAS), st.text(max_size=30)))
    elif kind == "regex":
        out.regex = draw(_mix(st.sampled_from(["[ab]{1,3}", "x+", "(yes|no)"]),
                              st.text(max_size=12)))
    elif kind == "choice":
        out.choice.options.extend(draw(st.lists(
            _mix(st.text(min_size=1, max_size=6), st.text(max_size=6)), max_size=4)))
    else:
        out.grammar = draw(_mix(st.sampled_from(['root ::= "a" | "b"', 'start: "x"+']),
                                st.text(max_size=20)))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(req=requests())
# Found by this test: choice 1 of seed 2**63 - 1 drew from 2**63, which took the core down.
@example(req=pb.GenerateRequest(text="x", n=2, sampling=pb.SamplingParams(seed=2**63 - 1)))
# Found by a concurrent run of it: len**length_penalty overflowed a float in the front.
@example(req=pb.GenerateRequest(text="x", max_tokens=3,
                                beam_search=pb.BeamSearch(beam_width=2, length_penalty=3.2e16)))
def test_any_request_is_answered_or_refused_clearly(
        mesh: Mesh, stub: inference_pb2_grpc.InferenceServiceStub, req: pb.GenerateRequest
) -> None:
    try:
        responses = list(stub.Generate(req, timeout=60))
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        event(code.name)
        assert code in CLIENT_ERRORS, (code, details, req, _ending(mesh, code))
        assert details and any(f in details for f in FIELDS), (code, details, req)
    else:
        event("OK")
        assert responses and responses[-1].HasField("usage"), req
        assert not any(math.isnan(lp.logprob) for r in responses for lp in r.logprobs), req
    wait_idle(stub)


# Requests that run (most of `requests()` are refused): a few tokens to a few choices.
_runnable = st.builds(
    pb.GenerateRequest, text=_text, max_tokens=st.integers(1, 24), n=st.integers(1, 3),
    ignore_eos=st.booleans(), logprobs=st.integers(0, 2),
    sampling=st.builds(pb.SamplingParams, temperature=st.floats(0, 1, width=32),
                       seed=st.integers(-(2**63), 2**63 - 1)))

# How a concurrent call ends on the client's side: read to the end, cancelled after a
# number of responses, or given a deadline of so many seconds.
_endings = st.one_of(st.just(("read", 0.0)),
                     st.tuples(st.just("cancel"), st.integers(1, 4).map(float)),
                     st.tuples(st.just("deadline"), st.sampled_from([0.001, 0.01, 0.05, 0.3])))


async def _call(stub: inference_pb2_grpc.InferenceServiceStub, req: pb.GenerateRequest,
                ending: tuple[str, float]) -> str:
    """How the call ended: "OK", a status code's name, or "cancelled" by this client."""
    how, arg = ending
    call = stub.Generate(req, timeout=arg if how == "deadline" else 60)
    try:
        seen = 0
        async for _ in call:
            seen += 1
            if how == "cancel" and seen >= arg:
                call.cancel()
                return "cancelled"
        return "OK"
    except grpc.aio.AioRpcError as e:
        return "cancelled" if how == "cancel" and e.code() == grpc.StatusCode.CANCELLED \
            else e.code().name
    except asyncio.CancelledError:  # cancel() raced the stream's end
        return "cancelled"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.data_too_large])
@given(calls=st.lists(st.tuples(st.one_of(requests(), _runnable), _endings), min_size=2,
                      max_size=10))
def test_concurrent_calls_cancelled_or_cut_by_deadlines_leave_the_mesh_idle(
        mesh: Mesh, stub: inference_pb2_grpc.InferenceServiceStub,
        calls: list[tuple[pb.GenerateRequest, tuple[str, float]]]) -> None:
    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(mesh.address) as channel:
            aio_stub = inference_pb2_grpc.InferenceServiceStub(channel)
            return list(await asyncio.gather(*(_call(aio_stub, r, e) for r, e in calls)))

    allowed = {c.name for c in CLIENT_ERRORS} | {"OK"}
    for (req, (how, _)), got in zip(calls, asyncio.run(run()), strict=True):
        event(got)
        expected = allowed | ({"cancelled"} if how == "cancel" else set()) | (
            {"DEADLINE_EXCEEDED"} if how == "deadline" else set())
        assert got in expected, (got, how, req, _ending(mesh, grpc.StatusCode.UNAVAILABLE)
                                 if got == "UNAVAILABLE" else "")
    wait_idle(stub)
