"""W5: online serving latency, direct gRPC and streamed HTTP through the gateway, per rate.

One mesh (`stagemesh serve` with its gateway, prefix caching off so every prompt is
computed) serves, for each rate in `--rates`, one seeded Poisson arrival schedule of
`--requests` requests. With both paths (`--paths grpc,http`) the requests alternate between
them in ABBA order, half each: direct gRPC (`router.client.RouterClient`) and streamed
/v1/completions through the gateway. Interleaving puts both paths under the same load at the
same moments, so their ratio holds on a shared, noisy machine; the rate is the load on the
server, both paths together. Prompts are random token ids in the ordinary-token range
(`--prompt-kind ids`), or text of the same length under the model's tokenizer, which the
front tokenizes (`--prompt-kind text`, as users' prompts are); outputs have a fixed length
(EOS ignored). `--warmup` requests per path go first, one at a time, and are not measured.

Metrics as vLLM's `bench serve`: TTFT from send to the first streamed token; TPOT per request
= (last token - first token) / (output tokens - 1); ITL = the gaps between streamed chunks
that carry tokens (the gateway is asked for `return_token_ids`, so a chunk counts whether or
not its text is empty); percentiles by linear interpolation. Throughput is over the schedule
(first send to last response). Goodput: the requests with TTFT <= --ttft-slo-ms and TPOT <=
--tpot-slo-ms, as a share of the path's requests (failed ones count against it) and per
second. The ratio rows are http / grpc. The JSON goes to --out (rewritten after each rate),
the latency-vs-rate plot next to it (.png; skipped when matplotlib, the `bench` extra, is not
installed: `python -m benchmarks.serving_plot JSON` draws it later).

W5 on the GPU (`llama3-8b` shape, random bf16 weights; DIR = a tokenizer, e.g. the default
model's directory, `stagemesh fetch-model` prints it):

    python -m benchmarks.make_random_model --shape llama3-8b --tokenizer DIR --out /tmp/l8b
    python -m benchmarks.serving --model /tmp/l8b --device cuda --stages 1 \\
        --rates 2,8,32 --requests 500 --prompt-len 1024 --output-len 128

(500 requests per rate, 250 per path; the schedules alone last about 250 + 62 + 16 s.) To run
the rates separately, give each run its own --out, then plot them together with
`python -m benchmarks.serving_plot A.json B.json --out W5.png`.

At small scale on CPU (the default model, a few minutes):

    python -m benchmarks.serving --rates 0.5,1 --requests 8 --prompt-len 64 \\
        --output-len 16 --stages 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np

from benchmarks.report import git_revision, print_table, write_json
from benchmarks.serving_metrics import Result, ratio_row, summarize, table
from benchmarks.text_prompts import FIRST_ORDINARY_ID, load_tokenizer, text_prompts
from foundation.modelstore import resolve_model
from router.client import RouterClient
from stagemesh.local_mesh import Mesh, free_port

PATHS = ("grpc", "http")
PROMPT_KINDS = {"ids": "random token ids, EOS ignored",
                "text": "text of random tokens, the prompt length under the model's "
                        "tokenizer, EOS ignored"}
W5 = {"rates": [2.0, 8.0, 32.0], "requests": 500, "prompt_len": 1024, "output_len": 128}


Prompt = list[int] | str  # token ids, or text the front tokenizes (`--prompt-kind`)
Send = Callable[[Prompt, int], Coroutine[Any, Any, Result]]


async def grpc_request(client: RouterClient, prompt: Prompt, out_len: int,
                       temperature: float = 0.0) -> Result:
    r = Result(time.perf_counter())
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    try:
        async for chunk in client.generate(text, token_ids=ids, max_tokens=out_len,
                                           ignore_eos=True, temperature=temperature):
            if chunk.token_ids:
                r.chunks.append(time.perf_counter())
                r.tokens += len(chunk.token_ids)
            if chunk.text and r.texted is None:
                r.texted = time.perf_counter()
    except Exception as e:  # a failed request is counted, not fatal
        r.error = repr(e)
    return r


async def http_request(http: httpx.AsyncClient, model: str, prompt: Prompt,
                       out_len: int, temperature: float = 0.0) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    r = Result(time.perf_counter())

    async def trace(event: str, info: dict[str, Any]) -> None:
        if r.wrote is None and event.endswith("send_request_headers.started"):
            r.wrote = time.perf_counter()

    try:
        async with http.stream("POST", "/v1/completions", json=body,
                               extensions={"trace": trace}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("usage"):
                    r.tokens = event["usage"]["completion_tokens"]
                elif event.get("choices"):
                    choice = event["choices"][0]
                    if choice.get("token_ids"):
                        r.chunks.append(time.perf_counter())
                    if choice.get("text") and r.texted is None:
                        r.texted = time.perf_counter()
    except Exception as e:
        r.error = repr(e)
    return r


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> list[float]:
    """Send times (s after the start) of n Poisson arrivals at `rate` req/s; the first at 0."""
    gaps = rng.exponential(1.0 / rate, n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:n]


def schedule(seed: int, index: int, rate: float, n: int) -> list[float]:
    """The arrival times of the run's index-th rate (seeded: the same in every run)."""
    return poisson_arrivals(np.random.default_rng([seed, index, 0]), rate, n)


def abba(paths: list[str], n: int) -> list[str]:
    """The path of each of n requests: A B B A A B B A ... (A B C C B A ... for three)."""
    k = len(paths)
    return [paths[i % k] if (i // k) % 2 == 0 else paths[k - 1 - i % k] for i in range(n)]


async def run_schedule(sends: list[Send], prompts: list[Prompt], arrivals: list[float],
                       out_len: int, start: float | None = None
                       ) -> tuple[list[Result], float]:
    """Request i (prompt i, sent by sends[i]) at arrivals[i] after `start` (a perf_counter
    time; default now), whatever the earlier ones are doing; (results, wall time from the
    first arrival to the last response)."""
    start = time.perf_counter() if start is None else start
    tasks: list[asyncio.Task[Result]] = []
    for send, prompt, at in zip(sends, prompts, arrivals, strict=True):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(prompt, out_len)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start - arrivals[0]


async def run_rate(client: RouterClient, http: httpx.AsyncClient, model: str,
                   vocab_size: int, args: argparse.Namespace, rate: float, index: int,
                   arrivals: list[float] | None = None,
                   ready: Callable[[], Coroutine[Any, Any, float]] | None = None
                   ) -> tuple[list[str], list[Result], float]:
    """One rate's warm-up and schedule: (the path of each request, its result, the
    schedule's wall time). `arrivals` replaces the seeded schedule; `ready`, awaited after
    the warm-up, returns the perf_counter time the schedule starts from."""
    paths: list[str] = args.paths
    arrivals = schedule(args.seed, index, rate, args.requests) if arrivals is None \
        else arrivals
    n = len(arrivals)
    rng = np.random.default_rng([args.seed, index, 1])
    count = n + args.warmup * len(paths)
    prompts: list[Prompt]
    if args.prompt_kind == "text":
        tokenizer = load_tokenizer(resolve_model(args.model))
        prompts = [*text_prompts(tokenizer, rng, count, args.prompt_len)]
    else:
        prompts = [rng.integers(FIRST_ORDINARY_ID, vocab_size, args.prompt_len).tolist()
                   for _ in range(count)]

    async def via_grpc(prompt: Prompt, out_len: int) -> Result:
        return await grpc_request(client, prompt, out_len, args.temperature)

    async def via_http(prompt: Prompt, out_len: int) -> Result:
        return await http_request(http, model, prompt, out_len, args.temperature)

    send: dict[str, Send] = {"grpc": via_grpc, "http": via_http}
    for i in range(args.warmup):  # connections, the gateway's model info, caches
        for j, path in enumerate(paths):
            r = await send[path](prompts[n + i * len(paths) + j], args.output_len)
            if r.error:
                raise SystemExit(f"warm-up request over {path} failed: {r.error}")
    order = abba(paths, n)
    start = await ready() if ready is not None else None
    results, duration = await run_schedule([send[p] for p in order], prompts[:n], arrivals,
                                           args.output_len, start)
    return order, results, duration


def rate_rows(rate: float, order: list[str], results: list[Result], duration: float,
              args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of one rate: one per path, then the ratio http / grpc."""
    paths: list[str] = args.paths
    rows = [{"rate": rate, **summarize(
        path, [r for r, p in zip(results, order, strict=True) if p == path], duration,
        args.output_len, args.ttft_slo_ms, args.tpot_slo_ms)} for path in paths]
    if "grpc" in paths and "http" in paths:
        rows.append(ratio_row(rate, rows[paths.index("grpc")], rows[paths.index("http")]))
    return rows


@contextlib.asynccontextmanager
async def clients(mesh: Mesh) -> AsyncIterator[tuple[RouterClient, httpx.AsyncClient]]:
    """A gRPC client of the router and an HTTP client of the gateway (no connection cap:
    every request of a schedule gets its own connection at once, as gRPC's streams do)."""
    assert mesh.gateway_url is not None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with RouterClient(mesh.address) as client, \
            httpx.AsyncClient(base_url=mesh.gateway_url, timeout=3600, limits=limits) as http:
        yield client, http


def served(info: Any) -> dict[str, Any]:
    """What the router says it serves (GetModelInfo)."""
    return {"model": info.model, "dtype": info.dtype, "stages": info.num_stages,
            "tp": info.tp_size, "block_size": info.block_size,
            "context_length": info.context_length, "vocab_size": info.vocab_size,
            "hop_transports": list(info.hop_transports)}


async def measure(mesh: Mesh, args: argparse.Namespace, config: dict[str, Any]
                  ) -> list[dict[str, Any]]:
    async with clients(mesh) as (client, http):
        info = await client.model_info()
        config["served"] = served(info)
        print("served:", config["served"], flush=True)
        rows: list[dict[str, Any]] = []
        for index, rate in enumerate(args.rates):
            order, results, duration = await run_rate(client, http, info.model,
                                                      info.vocab_size, args, rate, index)
            new = rate_rows(rate, order, results, duration, args)
            rows += new
            print_table(table(new))
            write_json(args.out, config, rows)  # a run cut short keeps the rates it finished
    return rows


def model_shape(model_dir: Path) -> dict[str, Any]:
    """The architecture figures of config.json that the protocol's shapes name."""
    cfg = json.loads((model_dir / "config.json").read_text())
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "tie_word_embeddings")
    shape = {k: cfg.get(k) for k in keys}
    shape["dtype"] = cfg.get("torch_dtype") or cfg.get("dtype")
    return shape


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive req/s: {text!r}")
    return rates


def parse_paths(text: str) -> list[str]:
    paths = [p.strip() for p in text.split(",") if p.strip()]
    if not paths or any(p not in PATHS for p in paths) or len(set(paths)) != len(paths):
        raise argparse.ArgumentTypeError(f"paths: a list of {', '.join(PATHS)}: {text!r}")
    return paths


def serve_flags(args: argparse.Namespace) -> list[str]:
    """The `stagemesh serve` flags of the run."""
    extra = args.extra.split()
    flags = ["--model", args.model, "--device", args.device, "--stages", str(args.stages),
             "--tp", str(args.tp), "--no-prefix-caching"]
    if args.device == "cpu" and not {"--num-blocks", "--kv-cache-gb"} & set(extra):
        flags += ["--num-blocks", "1024"]
    return flags + extra


def add_mesh_args(ap: argparse.ArgumentParser) -> None:
    """The flags that say which mesh to start (shared with benchmarks.serving_crosscheck)."""
    ap.add_argument("--model", default="default",
                    help="'default' (SmolLM2-135M-Instruct) or an HF-layout directory")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    ap.add_argument("--extra", default="",
                    help="more `stagemesh serve` flags, e.g. --extra='--enforce-eager' "
                         "(with '=' when it is one flag)")
    ap.add_argument("--prompt-len", type=int, default=W5["prompt_len"])
    ap.add_argument("--output-len", type=int, default=W5["output_len"])
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's temperature (0: greedy)")
    ap.add_argument("--prompt-kind", choices=("ids", "text"), default="ids",
                    help="ids: random ordinary token ids (no tokenization); text: text of "
                         "--prompt-len tokens under the model's tokenizer, which the front "
                         "tokenizes (benchmarks.text_prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)


def base_config(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    """What every W5 report says about the mesh: model, shape, device, layout, revision."""
    model_dir = resolve_model(args.model)
    return {  # the model directory's name only: its path is the machine's
        "workload": workload, "model": args.model, "model_dir_name": model_dir.name,
        "shape": model_shape(model_dir), "device": args.device, "stages": args.stages,
        "tp": args.tp, "transport": "gRPC control; data plane per hop: served.hop_transports",
        "prefix_caching": False,
        "serve_flags": " ".join(serve_flags(args)), "prompt_len": args.prompt_len,
        "output_len": args.output_len, "prompts": PROMPT_KINDS[args.prompt_kind],
        "temperature": args.temperature,
        "seed": args.seed, "revision": git_revision()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mesh_args(ap)
    ap.add_argument("--rates", type=parse_rates, default=W5["rates"],
                    help="Poisson arrival rates, req/s, comma-separated (both paths together)")
    ap.add_argument("--rate", type=float, help="one rate (the same as --rates RATE)")
    ap.add_argument("--requests", type=int, default=W5["requests"],
                    help="measured requests per rate, split evenly between the paths")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests per path")
    ap.add_argument("--paths", type=parse_paths, default=list(PATHS),
                    help="grpc (RouterClient), http (gateway /v1/completions, SSE), or both")
    ap.add_argument("--ttft-slo-ms", type=float, default=150.0, help="goodput: TTFT at most")
    ap.add_argument("--tpot-slo-ms", type=float, default=15.0, help="goodput: TPOT at most")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/w5-DEVICE-DATE.json); "
                         "the plot goes next to it as .png")
    args = ap.parse_args()
    if args.rate is not None:
        args.rates = [args.rate]
    if args.out is None:
        args.out = Path(f"benchmarks/results/w5-{args.device}-{dt.date.today()}.json")
    full = all(vars(args)[k] == v for k, v in W5.items())
    config = base_config(args, "W5" if full else "W5 (scaled down)")
    config |= {
        "rates_req_s": args.rates, "arrivals": "Poisson, seeded", "requests_per_rate":
        args.requests, "paths": args.paths,
        "order": "interleaved ABBA" if len(args.paths) > 1 else "one path",
        "warmup_per_path": args.warmup,
        "goodput_slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
        "http_client": "httpx2, raw SSE, return_token_ids",
        "grpc_client": "router.client.RouterClient"}
    print(json.dumps(config, indent=2), flush=True)
    with Mesh(*serve_flags(args), gateway_port=free_port(),
              timeout=args.startup_timeout) as mesh:
        rows = asyncio.run(measure(mesh, args, config))
    print()
    print_table(table(rows))
    from benchmarks.serving_plot import plot_latency_vs_rate

    png = args.out.with_suffix(".png")
    if plot_latency_vs_rate(rows, png, config):
        print(f"wrote {png}")
    else:
        print("plot skipped: matplotlib is not installed (`pip install -e '.[bench]'`; the "
              "JSON has the figures: `python -m benchmarks.serving_plot JSON` draws it)")


if __name__ == "__main__":
    main()
