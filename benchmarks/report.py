"""Shared reporting for benchmark scripts: configuration header, table, JSON with revision."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def git_revision() -> str:
    """The revision under test: $STAGEMESH_REV (set where the tree has no .git), else git."""
    if rev := os.environ.get("STAGEMESH_REV"):
        return rev
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def python_ns_per_op(iterations: int = 200_000, repeats: int = 5) -> float:
    """Nanoseconds per iteration of a fixed pure-Python loop (dict and list work, best of
    `repeats`): how fast this machine's interpreter runs at the time of the call. Figures
    bound by Python on the CPU (W6, the scheduler) move with it from one machine, or one
    hour of a shared VM, to the next; set beside them, it says which differences are the
    machine's. The loop must never change, or its figures stop comparing with earlier ones."""
    best = float("inf")
    for _ in range(repeats):
        table: dict[int, int] = {}
        items: list[int] = []
        started = time.perf_counter()
        for i in range(iterations):
            table[i & 1023] = i
            items.append(table.get(i & 511, 0) + len(items))
            if len(items) > 1024:
                items.clear()
        best = min(best, time.perf_counter() - started)
    return best / iterations * 1e9


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_json(path: Path, config: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"date": dt.date.today().isoformat(), "revision": git_revision(), "config": config,
           "results": rows}
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")


def stage_figures(address: str) -> list[dict[str, float]]:
    """Each stage's figures over the last 10 s, as the router's GetStats reports them:
    its pipeline bubble (share of time it waited for input) and mean step time."""
    import asyncio

    from router.client import RouterClient

    async def ask() -> list[dict[str, float]]:
        async with RouterClient(address) as client:
            stats = await client.stats(timeout=30)
        return [{"bubble": s.bubble_fraction, "step_ms": s.step_time_ms} for s in stats.stages]

    return asyncio.run(ask())


def model_info(address: str) -> Any:
    """The router's GetModelInfo answer: the mesh a figure was measured on, as its router
    reports it (each hop's data-plane transport, the micro-batches in flight), not what was
    asked for."""
    import asyncio

    from router.client import RouterClient

    async def ask() -> Any:
        async with RouterClient(address) as client:
            return await client.model_info(timeout=30)

    return asyncio.run(ask())


def _role(cmdline: list[str]) -> str:
    """A mesh process's role from its command line."""
    if "router.core.process" in cmdline:
        return "engine core"
    if "router.front_process" in cmdline:
        return "front process"
    if "stage" in cmdline and "--stage-index" in cmdline:
        return f"stage {cmdline[cmdline.index('--stage-index') + 1]}"
    for role in ("router", "gateway", "serve"):
        if role in cmdline:
            return role
    return "other"


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wakeups(pid: int) -> int:
    """Voluntary context switches so far of every thread of process `pid`: how many times one
    of its threads blocked (a poll, a lock, a sleep) and was woken, from /proc (Linux)."""
    return _context_switches(pid, "\nvoluntary_ctxt_switches:")


def preemptions(pid: int) -> int:
    """Involuntary context switches so far of every thread of process `pid`: how many times
    the kernel took a core from one of its threads while it could still run (its slice
    ended, or a woken thread preempted it), from /proc (Linux)."""
    return _context_switches(pid, "\nnonvoluntary_ctxt_switches:")


def _context_switches(pid: int, field: str) -> int:
    """`field` of /proc/PID/task/TID/status, summed over the threads of `pid`."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        total += int(status.split(field, 1)[1].split(None, 1)[0])
    return total


def process_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by `root` and every process under it, summed
    by role ("router" is its front 0, "engine core", "stage 0", ...), from /proc (Linux).
    Two calls around a run give each part's CPU over it."""
    return _by_role(root, cpu_seconds)


def process_wakeups(root: int) -> dict[str, float]:
    """`wakeups` of `root` and every process under it, summed by role as `process_cpu`'s.
    Two calls around a run give each part's wake-ups over it."""
    return _by_role(root, wakeups)


def process_preemptions(root: int) -> dict[str, float]:
    """`preemptions` of `root` and every process under it, summed by role as `process_cpu`'s."""
    return _by_role(root, preemptions)


def _by_role(root: int, count: Callable[[int], float]) -> dict[str, float]:
    """`count(pid)` of `root` and every process under it, summed by `_role`."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, pp in parent.items() if pp == pid]
        tree.update(children)
        frontier += children
    out: dict[str, float] = {}
    for pid in tree:
        try:
            value = count(pid)
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read().split("\0")
        except OSError:  # the process ended meanwhile
            continue
        role = _role(cmdline)
        out[role] = out.get(role, 0.0) + value
    return out
