"""The flags and argument types more than one `stagemesh` service command declares.

This module owns what `stage`, `router`, `serve` and `gateway` share on the command line: the
environment fallbacks (`env`, `env_int`), the argument types (`whole`, `at_least_one`, `port`,
`seconds`, `positive_seconds`, a layer split),
and the flags that mean the same on every command that has them: the model, its
implementation, fp8 quantization, activation compression, tracing and the metrics port. A
command's own flags stay in its module (`cli_stage`, `cli_services`, `cli_gateway`);
credentials are in `cli_credentials`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeAlias

SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_int(name: str) -> int | None:
    """An optional port from the environment (unset or empty: None)."""
    value = os.environ.get(name, "")
    return int(value) if value else None


def add_tracing_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help=f"send OpenTelemetry traces ({what}) to this OTLP/gRPC collector, "
                        "e.g. http://127.0.0.1:4317 (default: $OTEL_EXPORTER_OTLP_TRACES_"
                        "ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing)")


def add_metrics_port_arg(p: argparse.ArgumentParser, env: str, what: str) -> None:
    p.add_argument("--metrics-port", type=port, default=env_int(env),
                   help=f"serve Prometheus metrics{what} at http://HOST:PORT/metrics (0: any "
                        f"free port; default: none) [${env}]")


def layer_split(text: str) -> tuple[int, ...]:
    """A stage's or serve's explicit split."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"layers must be comma-separated counts, got {text!r}") from None


def seconds(text: str) -> float:
    """A duration flag: a number of seconds, 0 or more."""
    return _duration(text, "seconds")


def milliseconds(text: str) -> float:
    """A duration flag in milliseconds, 0 or more."""
    return _duration(text, "milliseconds")


def _duration(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of {unit}: {text!r}") from None
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be 0 or more {unit}, got {text}")
    return value


def add_drain_timeout_arg(p: argparse.ArgumentParser, what: str, more: str = "") -> None:
    """--drain-timeout: on SIGTERM, how long `what` may take to finish (30 s by default);
    `more` follows in the help."""
    p.add_argument("--drain-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help=f"on SIGTERM, how long {what} may take to finish{more} "
                        "(default: %(default)s)")


def positive_seconds(text: str) -> float:
    """A duration that must pass before something is given up: more than 0 seconds."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def whole(least: int) -> Callable[[str], int]:
    """The argument type of a count or size flag: a whole number, `least` or more (the
    message names the bound; argparse adds the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return parse


at_least_one = whole(1)


def port(text: str) -> int:
    """A TCP port flag: 0 to 65535 (0: any free port, where the flag says so)."""
    value = whole(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number, 0 to 65535, got {value}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env("STAGEMESH_MODEL", "default"),
                   help="'default' (SmolLM2-135M-Instruct) or an HF-layout directory "
                        "[$STAGEMESH_MODEL]")


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default="none", choices=("none", "fp8"),
                   help="fp8: the decoder layers' projections stored as e4m3 with one scale "
                        "per output feature (half the weight memory and bytes per decode "
                        "step; FP8 kernels on CUDA devices of compute capability 8.9+, the "
                        "torch reference elsewhere; docs/BENCHMARKS.md states its accuracy)")


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="the KV cache's storage: auto (the model's dtype) or fp8 (e4m3 at "
                        "unit scale, values past +-448 saturated: twice the blocks in the "
                        "same memory, half the bytes a decode step's attention reads; "
                        "docs/BENCHMARKS.md states its accuracy)")


def add_compression_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activation-compression", default="none",
                   choices=("none", "bf16", "fp16", "int8"),
                   help="form of the activations a stage sends downstream: as computed, cast "
                        "to 16 bits, or int8 with a scale per token (for links where "
                        "bandwidth is scarce; docs/BENCHMARKS.md gives each one's error)")


def add_model_impl_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-impl", default="auto", choices=("auto", "llama", "null"),
                   help="model implementation: auto/llama (the model's weights), or null (no "
                        "model compute, no weights: control-plane benchmark)")
