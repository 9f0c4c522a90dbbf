"""Router chunks -> OpenAI JSON, token texts, and the Prometheus text, without processes."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.convert import ResponseBuilder, router_requests
from gateway.metrics import GatewayMetrics
from gateway.params import parse_chat, parse_completions
from gateway.tokens import TokenTexts
from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import Chunk
from tests.default_model import default_model_dir


@pytest.fixture(scope="module")
def texts() -> TokenTexts:
    return TokenTexts.from_dir(default_model_dir())


def _chunk(index: int, text: str, ids: tuple[int, ...], finish: str | None = None,
           logprobs: tuple[Any, ...] = ()) -> Chunk:
    return Chunk("r", index, text, ids, finish, logprobs)


def _usage(prompt: int, completion: int) -> Chunk:
    return Chunk("r", 0, "", (), None, (), {"prompt_tokens": prompt,
                                            "completion_tokens": completion,
                                            "cached_prompt_tokens": 1})


def test_token_texts_render_partial_characters_as_bytes(texts: TokenTexts) -> None:
    assert texts.get(260) == (" the", [32, 116, 104, 101])
    assert texts.get(2) == ("<|im_end|>", list(b"<|im_end|>"))
    # '日' is split over two tokens: neither is UTF-8 alone, together they are.
    first, second = texts.get(23274), texts.get(115)
    assert first[0] == "bytes:\\xe6\\x97" and second[0] == "bytes:\\xa5"
    assert first[1] is not None and second[1] is not None
    assert bytes(first[1] + second[1]).decode() == "日"
    assert TokenTexts(None).get(42) == ("token_id:42", None)


def test_router_requests_one_per_prompt() -> None:
    spec = parse_completions({"prompt": ["a", [7, 8]], "n": 2, "seed": 3, "max_tokens": 5,
                              "stop": ["x"], "ignore_eos": True}, max_prompts=4)
    first, second = router_requests(spec, "", "cmpl-1")
    assert (first.text, list(second.token_ids.ids)) == ("a", [7, 8])
    assert (first.request_id, second.request_id) == ("cmpl-1-0", "cmpl-1-1")
    for r in (first, second):
        assert (r.n, r.max_tokens, list(r.stop), r.ignore_eos) == (2, 5, ["x"], True)
        assert r.sampling.seed == 3 and not r.sampling.HasField("temperature")
        assert not r.HasField("logprobs")
    chat = router_requests(parse_chat({"messages": [{"role": "user", "content": "q"}]}),
                           "m", "c")
    assert chat[0].WhichOneof("input") == "chat" and chat[0].model == "m"
    assert isinstance(chat[0], pb.GenerateRequest) and not chat[0].HasField("max_tokens")


def test_choice_indices_and_usage_over_prompts(texts: TokenTexts) -> None:
    spec = parse_completions({"prompt": ["a", "b"], "n": 2}, max_prompts=4)
    b = ResponseBuilder(spec, "cmpl-x", "m", 1, texts)
    b.delta(1, _chunk(1, "B1", (5,), "length"))
    b.delta(0, _chunk(0, "A", (1,)))
    b.delta(0, _chunk(0, "0", (2,), "stop"))
    b.delta(0, _chunk(1, "A1", (3,), "length"))
    b.delta(1, _chunk(0, "B0", (4,), "length"))
    assert b.delta(0, _usage(3, 3)) is None and b.delta(1, _usage(4, 2)) is None
    r = b.response()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in r["choices"]] == [
        (0, "A0", "stop"), (1, "A1", "length"), (2, "B0", "length"), (3, "B1", "length")]
    assert r["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                          "prompt_tokens_details": {"cached_tokens": 2}}
    assert r["object"] == "text_completion" and r["id"] == "cmpl-x"


def test_chat_stream_chunks(texts: TokenTexts) -> None:
    spec = parse_chat({"messages": [{"role": "user", "content": "q"}], "stream": True,
                       "stream_options": {"include_usage": True}})
    b = ResponseBuilder(spec, "chatcmpl-x", "m", 1, texts)
    first = b.stream_chunk(b.delta(0, _chunk(0, "", (23274,))))  # type: ignore[arg-type]
    assert first is not None and first["choices"][0]["delta"] == {"role": "assistant",
                                                                  "content": ""}
    assert first["usage"] is None and first["object"] == "chat.completion.chunk"
    held = b.delta(0, _chunk(0, "", (9,)))  # a token whose text is held back: nothing to send
    assert held is not None and b.stream_chunk(held) is None
    last = b.stream_chunk(b.delta(0, _chunk(0, "日", (115,), "stop")))  # type: ignore[arg-type]
    assert last is not None and last["choices"][0] == {
        "index": 0, "delta": {"content": "日"}, "logprobs": None, "finish_reason": "stop",
        "stop_reason": None}  # vLLM's: None, the model's EOS
    b.delta(0, _usage(2, 3))
    assert b.usage_chunk()["choices"] == [] and b.usage_chunk()["usage"]["total_tokens"] == 5


def test_completion_logprobs_offsets_count_characters(texts: TokenTexts) -> None:
    spec = parse_completions({"prompt": "a", "logprobs": 1}, max_prompts=4)
    b = ResponseBuilder(spec, "c", "m", 1, texts)
    # " the" then the two halves of '日' (text arrives with the second) then " the".
    b.delta(0, _chunk(0, " the", (260,), None, ((260, -0.5, ((260, -0.5),)),)))
    b.delta(0, _chunk(0, "日 the", (23274, 115, 260), "length",
                      ((23274, -1.0, ((9, -0.2),)), (115, -0.1, ()), (260, -0.3, ()))))
    lp = b.response()["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, 4, 4, 5]  # '日' starts at 4; the next token at 5
    assert lp["token_logprobs"] == [-0.5, -1.0, -0.1, -0.3]
    assert lp["top_logprobs"][1] == {texts.get(9)[0]: -0.2, "bytes:\\xe6\\x97": -1.0}


def test_metrics_text_with_and_without_router_stats() -> None:
    m = GatewayMetrics()
    m.requests.labels('/v1/"x"\n', "GET", "200").inc()
    m.duration.labels("/a").observe(0.05)
    m.duration.labels("/a").observe(7.0)
    stats = pb.GetStatsResponse(num_running=2, kv_blocks_used=5, kv_blocks_total=64, steps=9,
                                stages=[
        pb.StageStats(stage=0, kv_blocks_used=5, kv_blocks_total=64, ready=True,
                      transport="cuda_ipc"),
        pb.StageStats(stage=1, kv_blocks_used=4, kv_blocks_total=64, ready=True)])
    text = m.render(stats).decode()
    # prometheus_client's own parser reads it back (escaped label values included)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("stagemesh_gateway_requests_total",
                    (("method", "GET"), ("route", '/v1/"x"\n'), ("status", "200")))] == 1
    assert samples[("stagemesh_gateway_request_duration_seconds_bucket",
                    (("le", "0.05"), ("route", "/a")))] == 1  # cumulative buckets
    assert samples[("stagemesh_gateway_request_duration_seconds_bucket",
                    (("le", "+Inf"), ("route", "/a")))] == 2
    assert samples[("stagemesh_kv_blocks_used", (("stage", "0"),))] == 5
    assert samples[("stagemesh_kv_blocks_used", (("stage", "1"),))] == 4
    assert samples[("stagemesh_router_requests_running", ())] == 2
    assert samples[("stagemesh_router_steps_total", ())] == 9
    hops = {k: v for k, v in samples.items() if k[0] == "stagemesh_stage_hop_transport"}
    assert hops == {("stagemesh_stage_hop_transport",
                     (("stage", "0"), ("transport", "cuda_ipc"))): 1}
    assert "# TYPE stagemesh_kv_blocks_used gauge" in text.splitlines()
    down = m.render(None).decode().splitlines()
    assert "stagemesh_router_up 0.0" in down
    assert not any(line.startswith("stagemesh_kv_blocks_used") for line in down)
