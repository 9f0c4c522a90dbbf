"""`stagemesh status`: the mesh at a glance from the router's GetStats, once or refreshed
(`--watch`), the way `nvidia-smi` shows its cards.

    stagemesh status [--router HOST:PORT] [--watch SECONDS]

The router's queue, KV use and steps, then one row per stage: its layers, device, KV blocks
in use, steps, its recent step time, its pipeline bubble (the share of the last 10 s it
waited for input) and the transport of the hop to the next stage. Plain text; with --watch
the terminal is cleared before each refresh, and steps/s comes from the difference between
two refreshes.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, TextIO

CLEAR = "\x1b[H\x1b[2J"


def render(stats: Any, router: str, steps_per_s: float | None = None) -> str:
    """The status text of one GetStats reply (`RouterClient.stats`; the protos stay behind
    the client) and `steps_per_s` from the previous one."""
    rate = f"  {steps_per_s:,.0f} steps/s" if steps_per_s is not None else ""
    kv = f"{stats.kv_blocks_used}/{stats.kv_blocks_total}"
    lines = [f"router {router}: {stats.num_running} running, {stats.num_waiting} waiting, "
             f"KV {kv} blocks ({stats.kv_blocks_cached} cached), prefix hits "
             f"{stats.prefix_cache_hit_rate:.0%}, {stats.steps:,} steps{rate}, "
             f"{stats.requests_finished:,} requests finished", ""]
    header = ("stage", "layers", "device", "ready", "KV blocks", "sequences", "steps",
              "step ms", "bubble", "hop")
    rows = [header]
    for s in stats.stages:
        rows.append((str(s.stage), f"{s.layer_start}-{s.layer_end - 1}", s.device or "-",
                     "yes" if s.ready else "NO", f"{s.kv_blocks_used}/{s.kv_blocks_total}",
                     str(s.num_sequences), f"{s.steps:,}", f"{s.step_time_ms:.2f}",
                     f"{s.bubble_fraction:.0%}", s.transport or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    return "\n".join(lines) + "\n"


async def run_status(router: str, watch_s: float | None, out: TextIO = sys.stdout,
                     credentials: Any = None,
                     metadata: list[tuple[str, str]] | None = None) -> int:
    """Print the status once, or every `watch_s` seconds until interrupted. Returns 1 (with
    the router's error on stderr) when the router cannot be asked."""
    import grpc

    from router.client import RouterClient

    previous: tuple[float, int] | None = None
    async with RouterClient(router, credentials, metadata=metadata or []) as client:
        while True:
            try:
                stats = await client.stats(timeout=10)
            except grpc.aio.AioRpcError as e:
                print(f"stagemesh status: {router}: {e.code().name}: {e.details()}",
                      file=sys.stderr)
                if watch_s is None:
                    return 1
                await asyncio.sleep(watch_s)
                continue
            now = time.monotonic()
            rate = None
            if previous is not None and now > previous[0]:
                rate = (stats.steps - previous[1]) / (now - previous[0])
            previous = (now, stats.steps)
            text = render(stats, router, rate)
            out.write(CLEAR + text if watch_s is not None else text)
            out.flush()
            if watch_s is None:
                return 0
            await asyncio.sleep(watch_s)
