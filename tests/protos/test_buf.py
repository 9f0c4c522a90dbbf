"""The protos' checks of the test command (`scripts/buf.sh`) can fail: a public field
renumbered is a breaking change, a badly named message a lint error, each named by buf."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / ".venv" / "buf" / "node_modules" / ".bin" / "buf"

pytestmark = pytest.mark.skipif(not BUF.exists(), reason="buf is installed by scripts/buf.sh")


def _copy(tmp_path: Path, old: str, new: str) -> Path:
    protos = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", protos, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    path = protos / "stagemesh" / "v1" / "inference.proto"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return protos


def _buf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUF), *args], capture_output=True, text=True, timeout=120)


def test_the_current_protos_pass() -> None:
    assert _buf("lint", str(ROOT / "protos")).returncode == 0


def test_a_renumbered_public_field_is_a_breaking_change(tmp_path: Path) -> None:
    changed = _copy(tmp_path, "bool ignore_eos = 9;", "bool ignore_eos = 29;")
    out = _buf("breaking", str(changed), "--against", str(ROOT / "protos"))
    assert out.returncode != 0
    assert "ignore_eos" in out.stdout + out.stderr


def test_a_badly_named_message_is_a_lint_error(tmp_path: Path) -> None:
    changed = _copy(tmp_path, "message AbortResponse {}", "message abort_response {}\n"
                    "message AbortResponse {}")
    out = _buf("lint", str(changed))
    assert out.returncode != 0 and "abort_response" in out.stdout + out.stderr
