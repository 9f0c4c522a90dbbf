"""Time to resume after losing a stage: a standby taking its place against the stage's
restart in place, measured the same way, in one run.

    python -m benchmarks.failover --rounds 2 --out benchmarks/results/failover-DATE.json

Both on the default model on CPU (by default), 2 stages, 16 greedy chat streams of 24
tokens; stage 1 is SIGKILLed once every stream has 4 tokens. Restart in place: `stagemesh
serve` restarts the stage. Standby: two stages, one standby and a router with
`--standby-stages` and `--standby-grace`, as separate processes; nothing restarts the
stage, the standby takes its place. The figure is the time from the kill until every
stream has a token again; every stream's text must equal the fault-free run's.

Restart in place also runs on GPUs, on any model, TP size and transport (the standby's runs
on CPU only), e.g. 2 stages x TP 2 on 4 GPUs with NCCL hops; the hops' transports after the
restart are reported (the re-link builds them anew):

    python -m benchmarks.failover --how restart --model DIR --device cuda --tp 2 \
        --transport nccl
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import signal
import sys
from pathlib import Path
from typing import Any

from benchmarks.report import git_revision, model_info, print_table, write_json
from foundation.modelstore import resolve_model
from stagemesh.local_mesh import Mesh, Proc, free_port
from tests.mesh.harness import SERVING, greedy_streams, wait_status

STREAMS, TOKENS = 16, 24
PROMPTS = [f"Write one sentence about the number {i}." for i in range(STREAMS)]


def restart_in_place(model: str, device: str = "cpu", tp: int = 1,
                     transport: str = "auto") -> dict[str, Any]:
    pool = ["--num-blocks", "256"] if device == "cpu" else []  # a GPU sizes its own
    with Mesh("--model", model, "--stages", "2", "--device", device, "--tp", str(tp),
              "--transport", transport, *pool, "--max-num-seqs", "32",
              "--recovery-budget", "120", "--step-timeout", "10", timeout=900) as mesh:
        want, _ = asyncio.run(greedy_streams(mesh.address, PROMPTS, TOKENS))
        before = list(model_info(mesh.address).hop_transports)
        pid = mesh.pid("stage 1")
        got, resumed = asyncio.run(greedy_streams(mesh.address, PROMPTS, TOKENS,
                                                  lambda: os.kill(pid, signal.SIGKILL)))
        after = list(model_info(mesh.address).hop_transports)
    return {"how": "restart in place (serve)", "resumed_s": resumed, "identical": got == want,
            "hops_before": before, "hops_after": after}


def standby(model: str, grace_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "stagemesh"]
    ports = [free_port() for _ in range(4)]
    stage = [*cmd, "stage", "--model", model, "--device", "cpu", "--num-blocks", "256",
             "--num-stages", "2", "--max-num-seqs", "32"]
    procs = [Proc([*stage, "--stage-index", "0", "--port", str(ports[0])]),
             Proc([*stage, "--stage-index", "1", "--port", str(ports[1])]),
             Proc([*stage, "--standby", "--port", str(ports[2])])]
    procs.append(Proc([*cmd, "router", "--model", model, "--port", str(ports[3]),
                       "--stages", f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
                       "--standby-stages", f"127.0.0.1:{ports[2]}",
                       "--standby-grace", str(grace_s), "--recovery-budget", "120",
                       "--step-timeout", "10", "--max-num-seqs", "32"]))
    address = f"127.0.0.1:{ports[3]}"
    try:
        wait_status(address, SERVING, 240)
        want, _ = asyncio.run(greedy_streams(address, PROMPTS, TOKENS))
        got, resumed = asyncio.run(greedy_streams(
            address, PROMPTS, TOKENS, lambda: procs[1].proc.send_signal(signal.SIGKILL)))
    finally:
        for p in reversed(procs):
            p.stop(timeout=30)
    return {"how": f"standby (grace {grace_s:g} s)", "resumed_s": resumed,
            "identical": got == want}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--how", default="restart,standby", help="of restart, standby")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu", help="restart in place: cpu or cuda")
    ap.add_argument("--tp", type=int, default=1, help="restart in place: TP size per stage")
    ap.add_argument("--transport", default="auto",
                    help="restart in place: the hops' transport (auto, tcp, cuda_ipc, nccl)")
    ap.add_argument("--grace", type=float, default=2.0, help="the router's --standby-grace")
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/failover-{dt.date.today()}.json"))
    args = ap.parse_args()
    hows = args.how.split(",")
    if unknown := set(hows) - {"restart", "standby"}:
        ap.error(f"--how: unknown {', '.join(sorted(unknown))} (of restart, standby)")
    if "standby" in hows and args.device != "cpu":
        ap.error("--how standby runs on CPU only; use --how restart with --device cuda")
    model = str(resolve_model(args.model))
    config = {"workload": "stage loss under 16 greedy streams", "model": args.model,
              "device": args.device, "tp": args.tp, "transport": args.transport,
              "stages": 2, "streams": STREAMS, "tokens": TOKENS, "rounds": args.rounds,
              "standby_grace_s": args.grace, "revision": git_revision()}
    print(config, flush=True)
    runs = {"restart": lambda: restart_in_place(model, args.device, args.tp, args.transport),
            "standby": lambda: standby(model, args.grace)}
    rows = []
    for r in range(args.rounds):  # alternating, so drift on the machine hits both alike
        for how in (hows if r % 2 == 0 else hows[::-1]):
            row = {"round": r + 1, **runs[how]()}
            print(row, flush=True)
            rows.append(row)
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
