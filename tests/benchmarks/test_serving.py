"""W5's figures from client-side timings (no mesh): the schedule, the metric definitions,
goodput, the plot, and the guidellm cross-check's reading of guidellm's records."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.serving import abba, parse_paths, parse_rates, poisson_arrivals, rate_rows, schedule
from benchmarks.serving_crosscheck import guidellm_recomputed, guidellm_reported
from benchmarks.serving_metrics import Result, summarize


def test_abba_alternates_and_splits_evenly() -> None:
    assert abba(["grpc", "http"], 8) == ["grpc", "http", "http", "grpc"] * 2
    assert abba(["http"], 3) == ["http"] * 3


def test_poisson_schedule_is_seeded_and_has_the_rate() -> None:
    a = schedule(0, 1, 4.0, 4000)
    assert a == schedule(0, 1, 4.0, 4000) and a != schedule(0, 2, 4.0, 4000)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    assert len(a) / a[-1] == pytest.approx(4.0, rel=0.05)
    assert poisson_arrivals(np.random.default_rng(0), 1.0, 1) == [0.0]


def test_parse_rates_and_paths() -> None:
    assert parse_rates("2,8,32") == [2.0, 8.0, 32.0]
    assert parse_paths("http") == ["http"]
    for bad in ("0", "", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
    for bad in ("grpc,grpc", "rest", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_paths(bad)


def request(sent: float, chunks: list[float], tokens: int | None = None) -> Result:
    return Result(sent, chunks, len(chunks) if tokens is None else tokens)


def test_summarize_uses_the_vllm_definitions() -> None:
    # a: TTFT 100 ms, chunks 10 ms apart (TPOT 10); b: TTFT 300, TPOT 20 ms, gaps 10 and 30
    a = request(0.0, [0.1, 0.11, 0.12, 0.13])
    b = request(1.0, [1.3, 1.31, 1.34])
    failed = Result(2.0, error="boom")
    row = summarize("http", [a, b, failed], duration=2.0, out_len=4, ttft_slo_ms=150,
                    tpot_slo_ms=15)
    assert (row["requests"], row["ok"], row["failed"], row["short"]) == (3, 2, 1, 1)
    assert row["ttft_ms_mean"] == pytest.approx(200)
    assert row["ttft_ms_p50"] == pytest.approx(200)  # linear interpolation
    assert row["ttft_ms_p99"] == pytest.approx(100 + 0.99 * 200)
    assert row["tpot_ms_mean"] == pytest.approx(15)
    assert row["itl_ms_mean"] == pytest.approx(70 / 5)  # five gaps: 10, 10, 10, 10, 30
    assert row["itl_ms_p50"] == pytest.approx(10)
    assert row["req_s"] == pytest.approx(1.0) and row["out_tok_s"] == pytest.approx(3.5)
    # only a meets both objectives; the failed request counts against the share
    assert row["goodput_pct"] == pytest.approx(100 / 3)
    assert row["goodput_req_s"] == pytest.approx(0.5)
    assert row["errors"] == ["boom"]
    assert "send_lag_ms_mean" not in row  # only HTTP requests record when they went out
    # per request, in send order: seconds after the first send, TTFT and TPOT in ms
    assert row["per_request"] == [[0.0, 100.0, 10.0], [1.0, 300.0, 20.0]]
    a.wrote, b.wrote = 0.001, 1.003
    lagged = summarize("http", [a, b], duration=2.0, out_len=4, ttft_slo_ms=150,
                       tpot_slo_ms=15)
    assert lagged["send_lag_ms_mean"] == pytest.approx(2.0)


def test_rate_rows_split_by_path_with_a_ratio() -> None:
    args = argparse.Namespace(paths=["grpc", "http"], output_len=3, ttft_slo_ms=150.0,
                              tpot_slo_ms=15.0)
    fast = request(0.0, [0.1, 0.11, 0.12])
    slow = request(0.0, [0.2, 0.22, 0.24])
    rows = rate_rows(2.0, ["grpc", "http"], [fast, slow], 1.0, args)
    assert [r["path"] for r in rows] == ["grpc", "http", "http/grpc"]
    assert rows[2]["ttft_ms_mean"] == pytest.approx(2.0)
    assert rows[2]["tpot_ms_p99"] == pytest.approx(2.0)
    assert all(r["rate"] == 2.0 for r in rows)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.serving_plot import plot_latency_vs_rate

    rows = []
    for rate in (2.0, 8.0, 32.0):
        for path in ("grpc", "http"):
            rows.append({"rate": rate, "path": path, **{
                f"{m}_{k}": rate * (2 if k == "p99" else 1)
                for m in ("ttft_ms", "tpot_ms", "itl_ms") for k in ("p50", "p99")}})
        rows.append({"rate": rate, "path": "http/grpc"})
    png = tmp_path / "w5.png"
    assert plot_latency_vs_rate(rows, png, {"goodput_slo": {"ttft_ms": 150, "tpot_ms": 15}})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def guidellm_request(start: float, first: float, last: float, tokens: int) -> dict[str, Any]:
    return {"info": {"timings": {"request_start": start, "first_token_iteration": first,
                                 "last_token_iteration": last, "request_end": last + 0.001},
                     "error": None},
            "input_metrics": {"text_tokens": 64}, "output_metrics": {"text_tokens": tokens}}


def test_guidellm_records_read_with_our_definitions() -> None:
    warm = guidellm_request(0.0, 0.5, 1.0, 5)
    a = guidellm_request(10.0, 10.1, 10.14, 5)  # TTFT 100, TPOT 10
    b = guidellm_request(11.0, 11.3, 11.38, 5)  # TTFT 300, TPOT 20
    bad = guidellm_request(12.0, 12.1, 12.2, 0)
    bad["info"]["error"] = "HTTP 400"
    pad = guidellm_request(13.0, 13.1, 13.1, 1)
    bench = {"requests": {"successful": [b, warm, pad, a], "errored": [bad],
                          "incomplete": []}}
    row = guidellm_recomputed(bench, warmup=1, requests=3, out_len=5, ttft_slo_ms=150,
                              tpot_slo_ms=15)
    assert (row["requests"], row["ok"], row["failed"]) == (3, 2, 1)
    assert row["ttft_ms_mean"] == pytest.approx(200)
    assert row["tpot_ms_p50"] == pytest.approx(15)
    assert row["itl_ms_mean"] == pytest.approx(15)  # 120 ms over 8 gaps
    assert row["goodput_pct"] == pytest.approx(100 / 3)
    assert row["errors"] == ["HTTP 400"]


def test_guidellm_summary_maps_its_itl_to_our_tpot() -> None:
    def dist(mean: float, p50: float = 0.0, p99: float = 0.0, count: int = 3
             ) -> dict[str, Any]:
        return {"successful": {"mean": mean, "count": count,
                               "percentiles": {"p50": p50, "p99": p99}}}

    bench = {"duration": 10.0, "metrics": {
        "request_latency": dist(1.0), "requests_per_second": dist(0.3),
        "output_tokens_per_second": dist(5.0), "prompt_token_count": dist(64.0),
        "time_to_first_token_ms": dist(200.0, 190.0, 400.0, count=2),
        "inter_token_latency_ms": dist(15.0, 14.0, 30.0),
        "time_per_output_token_ms": dist(50.0)}}
    row = guidellm_reported(bench)
    assert (row["ok"], row["ttft_count"], row["ttft_ms_p99"]) == (3, 2, 400.0)
    assert (row["tpot_ms_mean"], row["tpot_ms_p50"], row["itl_ms_mean"]) == (15.0, 14.0, 15.0)
    assert row["tpot_incl_ttft_ms_mean"] == 50.0


def test_text_prompts_have_the_length_under_the_model_and_the_front() -> None:
    """`--prompt-kind text`: each prompt is exactly the asked number of tokens under HF
    transformers' tokenizer of the default model and under the front's own encoding (what
    the gateway's usage reports), and the prompts are seeded."""
    from transformers import AutoTokenizer

    from benchmarks.text_prompts import load_tokenizer, text_prompts
    from foundation.tokenizer import ModelTokenizer
    from tests.default_model import default_model_dir

    model_dir = default_model_dir()
    tok = load_tokenizer(model_dir)
    hf = AutoTokenizer.from_pretrained(model_dir)
    front = ModelTokenizer.from_dir(model_dir)
    for length in (1, 7, 64, 300):
        prompts = text_prompts(tok, np.random.default_rng([3, length]), 4, length)
        assert prompts == text_prompts(tok, np.random.default_rng([3, length]), 4, length)
        assert len(set(prompts)) == 4
        for p in prompts:
            assert len(hf(p, add_special_tokens=False)["input_ids"]) == length
            assert len(front.encode(p)) == length
