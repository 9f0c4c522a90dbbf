"""gRPC core's settings for the mesh's processes: set where absent, an operator's kept."""

from __future__ import annotations

import subprocess
import sys

from foundation.grpc_core import EXPERIMENTS_ENV, LEGACY_IO, apply_defaults


def test_the_legacy_io_experiments_are_set_where_the_environment_has_none() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    apply_defaults(env)
    assert env[EXPERIMENTS_ENV] == LEGACY_IO
    assert LEGACY_IO.split(",")[0] == "-event_engine_client"  # "-": each one turned off


def test_an_operators_value_wins_even_an_empty_one() -> None:
    for value in ("", "-event_engine_client", "some_experiment"):
        env = {EXPERIMENTS_ENV: value}
        apply_defaults(env)
        assert env == {EXPERIMENTS_ENV: value}


def test_the_command_sets_them_before_anything_imports_grpc() -> None:
    """`stagemesh.cli.run` applies them before its handlers run: importing the command must
    not import grpc (gRPC core would start with what the environment said before)."""
    code = "import sys, stagemesh.cli; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "False"
