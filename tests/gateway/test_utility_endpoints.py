"""vLLM's /tokenize, /detokenize and /version on the gateway, the router's Detokenize RPC,
X-Request-Id, unknown fields refused, and vLLM's request fields (include_stop_str_in_output,
continuous_usage_stats, skip_special_tokens, truncate_prompt_tokens), against the shared
2-stage mesh (the default model), through httpx and the official openai client."""

from __future__ import annotations

import grpc
import httpx2 as httpx
import openai
import pytest

from protos.stagemesh.v1 import inference_pb2 as pb
from protos.stagemesh.v1 import inference_pb2_grpc
from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.slow


def test_tokenize_detokenize_round_trip(base_url: str,
                                        stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    text = "The capital of France is Paris."
    got = httpx.post(base_url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                   "return_token_strs": True}, timeout=30)
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0
    assert body["max_model_len"] > body["count"]
    # the same ids the router's own Tokenize gives, which is what Generate uses
    assert body["tokens"] == list(stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)
    back = httpx.post(base_url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": text}
    chat = httpx.post(base_url + "/tokenize", json={
        "messages": [{"role": "user", "content": "Hi"}]}, timeout=30).json()
    assert chat["count"] > 3 and chat["token_strs"] is None
    reply = stub.Detokenize(pb.DetokenizeRequest(token_ids=chat["tokens"],
                                                 skip_special_tokens=True))
    assert "Hi" in reply.text and "<|im_start|>" not in reply.text


def test_tokenize_errors_name_the_field(base_url: str) -> None:
    def post(path: str, body: dict[str, object]) -> httpx.Response:
        return httpx.post(base_url + path, json=body, timeout=30)

    cases = [("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
             ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
             ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate"),
             ("/detokenize", {}, "tokens"),
             ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
             ("/detokenize", {"tokens": ["a"]}, "tokens[0]")]
    for path, body, param in cases:
        got = post(path, body)
        assert got.status_code == 400, (body, got.text)
        assert got.json()["error"]["param"] == param, (body, got.json())
    assert post("/detokenize", {"tokens": [1], "model": "other"}).status_code == 404


def test_version_is_open_and_names_the_package(base_url: str) -> None:
    got = httpx.get(base_url + "/version", timeout=10)
    assert got.status_code == 200 and got.json()["version"] not in ("", None)


def test_x_request_id_names_the_request_and_is_echoed(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hello", max_tokens=2, extra_headers={"X-Request-Id": "abc-123"})
    assert raw.headers["x-request-id"] == "abc-123"
    assert raw.parse().id == "cmpl-abc-123"
    plain = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert plain.headers["x-request-id"] == plain.parse().id  # a generated one
    bad = httpx.post(base_url + "/v1/completions", headers={"X-Request-Id": "a b"},
                     json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "a b"
    assert "X-Request-Id" in bad.json()["error"]["message"]


def test_unknown_extra_body_fields_are_refused(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_body={"allowed_token_ids": [1, 2]})
    assert bad.value.body["param"] == "allowed_token_ids"  # type: ignore[index]
    ok = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        metadata={"team": "a"}, store=False)
    assert ok.choices[0].message.content is not None


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(base_url: str, include: bool) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    free = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=8, temperature=0).choices[0].text
    stop = free.strip().split()[0]
    got = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
        stop=[stop], extra_body={"include_stop_str_in_output": include}).choices[0]
    assert got.finish_reason == "stop"
    assert got.text.endswith(stop) == include
    assert free.startswith(got.text)


def test_continuous_usage_stats_count_as_the_stream_goes(base_url: str) -> None:
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): every chunk carries
    the usage so far, the prompt's length from the router's first response."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    stream = client.completions.create(
        model=MODEL, prompt=["Once upon a time", "Hello"], max_tokens=6, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
    chunks = list(stream)
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.completion_tokens == 12
    seen = 0
    for chunk in chunks[:-1]:
        assert chunk.usage is not None
        seen += sum(len(getattr(c, "token_ids", None) or []) for c in chunk.choices)
        assert chunk.usage.completion_tokens == seen
        assert 0 < chunk.usage.prompt_tokens <= final.usage.prompt_tokens
    assert chunks[-2].usage is not None
    assert chunks[-2].usage.prompt_tokens == final.usage.prompt_tokens


def test_skip_special_tokens_and_truncate_prompt_tokens(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    texts = {}
    for skip in (True, False):
        reply = client.chat.completions.create(
            model=MODEL, messages=question, max_tokens=16, temperature=0,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True, "skip_special_tokens": skip})
        texts[skip] = reply.choices[0].message.content or ""
    assert "<|im_end|>" in texts[False] and "<|im_end|>" not in texts[True]
    assert texts[False].startswith(texts[True].split()[0])
    ids = list(range(1000, 1050))
    usage = client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": 5}).usage
    assert usage is not None and usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 0})
    assert bad.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_stop_reason_tells_eos_from_stop_strings_and_stop_tokens(
        base_url: str, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    eos = client.chat.completions.create(model=MODEL, messages=question,  # type: ignore[arg-type]
                                         max_tokens=40, temperature=0).choices[0]
    assert eos.finish_reason == "stop" and eos.model_extra["stop_reason"] is None  # type: ignore[index]
    free = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=6, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
    word = free.text.split()[0]
    by_string = client.completions.create(model=MODEL, prompt="The capital of France is",
                                          max_tokens=6, temperature=0, stop=[word]).choices[0]
    assert by_string.finish_reason == "stop"
    assert by_string.model_extra["stop_reason"] == word  # type: ignore[index]
    token = free.model_extra["token_ids"][1]  # type: ignore[index]
    streamed = list(client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
        stream=True, extra_body={"stop_token_ids": [token]}))
    last = streamed[-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == token  # type: ignore[index]
    # the same over gRPC: the last update of the choice names it
    request = pb.GenerateRequest(text="The capital of France is", max_tokens=6,
                                 stop_token_ids=[token])
    request.sampling.temperature = 0
    final = [r for r in stub.Generate(request, timeout=60) if r.finish_reason][-1]
    assert final.WhichOneof("stop_reason") == "stop_token_id" and final.stop_token_id == token


def test_unary_complete_equals_the_stream(stub: inference_pb2_grpc.InferenceServiceStub
                                          ) -> None:
    """Complete answers once with what Generate streams: the same greedy text and token ids
    per choice, finish and stop reasons, and usage; its errors are Generate's."""
    request = pb.GenerateRequest(text="The capital of France is", max_tokens=8, n=2,
                                 logprobs=1, stop=[" city"])
    request.sampling.temperature = 0
    streamed: dict[int, list[pb.GenerateResponse]] = {}
    usage = None
    for r in stub.Generate(request, timeout=60):
        if r.HasField("usage"):
            usage = r.usage
        else:
            streamed.setdefault(r.index, []).append(r)
    whole = stub.Complete(pb.CompleteRequest(request=request), timeout=60)
    assert whole.usage == usage and whole.request_id
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        parts = streamed[choice.index]
        assert choice.text == "".join(p.text for p in parts)
        assert list(choice.token_ids) == [t for p in parts for t in p.token_ids]
        assert len(choice.logprobs) == len(choice.token_ids)
        assert choice.finish_reason == parts[-1].finish_reason
        assert choice.WhichOneof("stop_reason") == parts[-1].WhichOneof("stop_reason")
    bad = pb.GenerateRequest(text="x")
    bad.sampling.temperature = -1
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(pb.CompleteRequest(request=bad), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in (info.value.details() or "")


def test_logit_bias_and_min_tokens_through_the_mesh(base_url: str) -> None:
    """OpenAI's logit_bias and vLLM's min_tokens reach the last stage's sampler: a +100
    bias makes greedy decoding repeat that token; min_tokens keeps EOS (and stop strings)
    away until that many tokens."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    forced = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
        logit_bias={"1234": 100}, extra_body={"return_token_ids": True}).choices[0]
    assert forced.model_extra["token_ids"] == [1234] * 5  # type: ignore[index]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    short = client.chat.completions.create(model=MODEL, messages=question,  # type: ignore[arg-type]
                                           max_tokens=60, temperature=0)
    assert short.choices[0].finish_reason == "stop"  # EOS well before 60 tokens
    assert short.usage is not None and short.usage.completion_tokens < 40
    long = client.chat.completions.create(model=MODEL, messages=question,  # type: ignore[arg-type]
                                          max_tokens=60, temperature=0,
                                          extra_body={"min_tokens": 50})
    assert long.usage is not None and long.usage.completion_tokens >= 50
    answer = short.choices[0].message.content or ""
    early = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=60, temperature=0,  # type: ignore[arg-type]
        stop=[answer.split()[0]], extra_body={"min_tokens": 50})
    assert (early.choices[0].message.content or "").startswith(answer.split()[0])
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"min_tokens": 3})
    assert bad.value.body["param"] == "min_tokens"  # type: ignore[index]


def test_the_final_response_says_where_the_time_went(
        stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    """Queue, prefill and decode times with the usage, within the call's own wall time."""
    import time

    request = pb.GenerateRequest(text="Tell me a story", max_tokens=12, ignore_eos=True)
    started = time.monotonic()
    final = list(stub.Generate(request, timeout=60))[-1]
    wall_ms = (time.monotonic() - started) * 1e3
    t = final.timing
    assert final.HasField("usage") and final.HasField("timing")
    assert t.queue_ms >= 0 and t.prefill_ms > 0 and t.decode_ms > 0
    assert t.queue_ms + t.prefill_ms + t.decode_ms <= wall_ms
    whole = stub.Complete(pb.CompleteRequest(request=request), timeout=60)
    assert whole.timing.prefill_ms > 0 and whole.timing.decode_ms > 0


def test_echo_puts_the_prompt_before_each_choice(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                      temperature=0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=4,
                                       temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == [prompt + plain] * 2
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True)
        if c.choices)
    assert streamed == prompt + plain
    ids = httpx.post(base_url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                       echo=True).choices[0].text
    assert by_ids == prompt + plain
