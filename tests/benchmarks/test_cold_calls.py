"""The cold-calls benchmark: every setting runs and writes its table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import cold_calls


def test_every_setting_is_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "cold.json"
    monkeypatch.setattr(sys, "argv", ["cold_calls", "--calls", "20", "--out", str(out)])
    cold_calls.main()
    doc = json.loads(out.read_text())
    rows = {r["setting"]: r for r in doc["results"]}
    assert list(rows) == ["loop", "after_python", "after_memory", "after_sleep"]
    assert all(r["timer_us"] > 0 for r in rows.values())
    assert rows["loop"]["vs_loop"] == 1
