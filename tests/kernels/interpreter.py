"""Run a kernel test's check in a child process under Triton's interpreter (TRITON_INTERPRET
must be set before triton is imported, so not in this process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(code: str) -> None:
    """Run `code` with TRITON_INTERPRET=1 from the repository root; fail the test with the
    child's stderr if it fails. Skips where triton is not installed (a `gpu` extra)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
