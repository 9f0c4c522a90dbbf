"""`stagemesh serve` restarts a dying stage with a growing backoff, and gives up with one line
past its cap instead of spinning on a process that crashes at start-up."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagemesh import launcher
from stagemesh.launcher import Child, RestartLimitError, _supervise


def _child(tmp_path: Path, code: str, restart: bool = True, role: str = "stage 0") -> Child:
    return Child(role, [sys.executable, "-c", code], tmp_path / role.replace(" ", ""),
                 restart=restart)


def test_backoff_doubles_while_it_keeps_dying_and_resets_after_a_stable_run(
        tmp_path: Path) -> None:
    c = _child(tmp_path, "")
    c.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    c.proc.wait()
    delays = []
    now = 1000.0
    for _ in range(5):
        c.started_at = now - 1.0  # died a second after its start
        delays.append(c.schedule_restart(now))
        now += 1.0
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0]
    c.deaths.clear()
    c.started_at = now - 120.0  # it ran for two minutes before dying
    assert c.schedule_restart(now) == 0.5
    assert c.restarts == 6 and c.restart_at == now + 0.5


def test_past_the_cap_it_names_the_child_and_stops(tmp_path: Path) -> None:
    c = _child(tmp_path, "", role="stage 1")
    c.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    c.proc.wait()
    for i in range(launcher.RESTART_LIMIT):
        c.schedule_restart(100.0 + i)
    with pytest.raises(RestartLimitError, match=r"stage 1 exited 6 times within 10 minutes "
                                                r"\(last status 7\); not restarting"):
        c.schedule_restart(106.0)
    # Deaths older than the window no longer count.
    c.deaths.clear()
    c.deaths.extend([0.0] * launcher.RESTART_LIMIT)
    c.schedule_restart(launcher.RESTART_WINDOW_S + 1.0)
    assert list(c.deaths) == [launcher.RESTART_WINDOW_S + 1.0]


def test_supervise_restarts_a_crashing_stage_then_gives_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "RESTART_BACKOFF_S", 0.05)
    monkeypatch.setattr(launcher, "RESTART_BACKOFF_MAX_S", 0.2)
    crashing = _child(tmp_path, "raise SystemExit(2)")
    router = _child(tmp_path, "import time; time.sleep(60)", restart=False, role="router")
    crashing.start()
    router.start()
    started = time.monotonic()
    try:
        with pytest.raises(RestartLimitError, match="stage 0 exited 6 times"):
            _supervise([crashing, router], {"signal": 0})
    finally:
        assert router.proc is not None
        router.proc.kill()
        router.proc.wait()
    assert crashing.restarts == launcher.RESTART_LIMIT
    assert time.monotonic() - started < 10
    err = capfd.readouterr().err
    assert "stage 0 exited (2); restarting in 0.1s (restart 2)" in err
    assert err.count("restarting in") == launcher.RESTART_LIMIT
