"""Every service's /metrics during a real run: `stagemesh serve` with 2 stages and the
gateway, requests over gRPC and HTTP, then each endpoint scraped and its counts checked
against what was sent (tokens, requests, finish reasons, steps) and its timings non-zero
where they must be (the second stage waits for the first: its bubble)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx2 as httpx
import pytest

from foundation.ports import free_port
from protos.stagemesh.v1 import inference_pb2 as pb
from router.client import build_request
from tests.mesh.harness import Mesh, wait_idle
from tests.prom import sample

pytestmark = pytest.mark.slow

PROMPTS = ("The capital of France is", "One, two, three,", "Hello")
TOKENS = 5  # per gRPC request (EOS ignored)
HTTP_TOKENS = 4


@dataclass(frozen=True)
class Seen:
    """What the services said right after the requests (stage windows are 10 s long)."""

    stats: pb.GetStatsResponse  # GetStats
    status: str  # `stagemesh status`


@pytest.fixture(scope="module")
def seen(scraped: tuple[Mesh, dict[str, str], int]) -> Seen:
    mesh = scraped[0]
    stats = mesh.stub().GetStats(pb.GetStatsRequest(), timeout=10)
    done = subprocess.run([sys.executable, "-m", "stagemesh", "status", "--router",
                           mesh.address], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return Seen(stats, done.stdout)


@pytest.fixture(scope="module")
def scraped() -> Iterator[tuple[Mesh, dict[str, str], int]]:
    """(the mesh, each role's /metrics text after the requests, prompt tokens sent)."""
    # An uneven split (serve --layers): each stage reports the layers it was given.
    with Mesh("--stages", "2", "--layers", "18,12", "--num-blocks", "256",
              gateway_port=free_port()) as mesh:
        stub = mesh.stub()
        prompt_tokens = 0
        for prompt in PROMPTS:
            prompt_tokens += len(stub.Tokenize(pb.TokenizeRequest(text=prompt),
                                               timeout=10).token_ids)
            chunks = list(stub.Generate(build_request(prompt, max_tokens=TOKENS,
                                                      ignore_eos=True), timeout=60))
            assert sum(len(c.token_ids) for c in chunks) == TOKENS
        assert mesh.gateway_url is not None
        reply = httpx.post(mesh.gateway_url + "/v1/completions", timeout=60, json={
            "prompt": "Tell me", "max_tokens": HTTP_TOKENS, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        prompt_tokens += reply.json()["usage"]["prompt_tokens"]
        wait_idle(stub)
        time.sleep(1.5)  # the core refreshes its gauges and step counts once a second
        texts = {role: httpx.get(url, timeout=10).text for role, url in mesh.metrics.items()}
        yield mesh, texts, prompt_tokens


def test_serve_prints_an_endpoint_for_every_service(
        scraped: tuple[Mesh, dict[str, str], int]) -> None:
    mesh, texts, _ = scraped
    assert set(mesh.metrics) == {"stage 0", "stage 1", "router", "gateway"}
    assert all(text.startswith("# HELP") for text in texts.values())


def test_router_counts_what_was_sent(scraped: tuple[Mesh, dict[str, str], int]) -> None:
    _, texts, prompt_tokens = scraped
    router = texts["router"]
    requests = len(PROMPTS) + 1

    def value(name: str, **labels: str) -> float | None:
        return sample(router, name, **labels)

    assert value("stagemesh_request_success_total", finished_reason="length") == requests
    assert value("stagemesh_generation_tokens_total") == len(PROMPTS) * TOKENS + HTTP_TOKENS
    assert value("stagemesh_prompt_tokens_total") == prompt_tokens
    assert value("stagemesh_time_to_first_token_seconds_count") == requests
    assert value("stagemesh_e2e_request_latency_seconds_count") == requests
    assert value("stagemesh_request_time_per_output_token_seconds_count") == requests
    # one streamed update per token after the first (--stream-interval 1)
    assert value("stagemesh_inter_token_latency_seconds_count") == \
        len(PROMPTS) * (TOKENS - 1) + HTTP_TOKENS - 1
    assert (value("stagemesh_time_to_first_token_seconds_sum") or 0) > 0
    steps = value("stagemesh_steps_total")
    assert steps is not None and steps >= TOKENS
    assert value("stagemesh_step_latency_seconds_count") == steps
    assert value("stagemesh_num_requests_running") == 0
    assert value("stagemesh_kv_cache_usage_perc") == 0
    assert value("stagemesh_run_ahead_depth") == 4  # a CPU model's steps: tens of ms, no deeper
    assert value("stagemesh_prefix_cache_queries_total") == prompt_tokens
    assert value("stagemesh_recoveries_total") == 0


def test_stages_count_the_same_steps_and_the_second_waits_for_the_first(
        scraped: tuple[Mesh, dict[str, str], int]) -> None:
    _, texts, _ = scraped
    steps = sample(texts["router"], "stagemesh_steps_total")
    first, second = texts["stage 0"], texts["stage 1"]
    for text in (first, second):
        assert sample(text, "stagemesh_stage_steps_total") == steps
        assert sample(text, "stagemesh_stage_kv_blocks_total") == 256
        assert sample(text, "stagemesh_stage_kv_blocks_used") == 0
        assert (sample(text, "stagemesh_stage_step_seconds_sum") or 0) > 0
    assert sample(first, "stagemesh_stage_tokens_total") == \
        sample(second, "stagemesh_stage_tokens_total")
    assert sample(first, "stagemesh_stage_layers_info", start="0", end="18") == 1
    assert sample(second, "stagemesh_stage_layers_info", start="18", end="30") == 1
    # the hop: stage 0 sends every step's activations over unix (two processes of one host)
    assert sample(first, "stagemesh_stage_hop_send_seconds_count", transport="unix") == steps
    assert sample(second, "stagemesh_stage_hop_send_seconds_count", transport="unix") is None
    # stage 1 waits for stage 0's compute on every step: a bubble
    assert (sample(second, "stagemesh_stage_input_wait_seconds_sum") or 0) > 0
    assert 0 < (sample(second, "stagemesh_stage_bubble_fraction") or 0) <= 1


def test_gateway_counts_its_request(scraped: tuple[Mesh, dict[str, str], int]) -> None:
    _, texts, _ = scraped
    gateway = texts["gateway"]
    assert sample(gateway, "stagemesh_gateway_requests_total", route="/v1/completions",
                  method="POST", status="200") == 1
    assert sample(gateway, "stagemesh_gateway_tokens_total", kind="completion") == HTTP_TOKENS
    assert sample(gateway, "stagemesh_router_up") == 1


def test_get_stats_and_status_show_each_stage_live(
        scraped: tuple[Mesh, dict[str, str], int], seen: Seen) -> None:
    steps = sample(scraped[1]["router"], "stagemesh_steps_total")
    first, second = seen.stats.stages
    assert (first.layer_start, first.layer_end, second.layer_start, second.layer_end) == \
        (0, 18, 18, 30)
    assert first.device == second.device == "cpu"
    assert first.steps == second.steps == steps
    assert first.step_time_ms > 0 and second.step_time_ms > 0
    assert 0 < second.bubble_fraction <= 1
    assert (first.transport, second.transport) == ("unix", "")
    lines = seen.status.splitlines()
    assert lines[0].startswith(f"router {scraped[0].address}: 0 running, 0 waiting")
    header = lines[2].split()
    assert header == ["stage", "layers", "device", "ready", "KV", "blocks", "sequences",
                      "steps", "step", "ms", "bubble", "hop"]
    rows = [line.split() for line in lines[3:]]
    assert [r[:4] for r in rows] == [["0", "0-17", "cpu", "yes"], ["1", "18-29", "cpu", "yes"]]
    assert [r[-1] for r in rows] == ["unix", "-"]
    assert rows[1][-2].endswith("%") and 0 < int(rows[1][-2][:-1]) <= 100  # a moment later
