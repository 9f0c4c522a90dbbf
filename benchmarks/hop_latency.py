"""Per-hop latency of the data plane between two stage processes on one host, device to
device, for each transport in one run.

    python -m benchmarks.hop_latency --device cuda --transports tcp,cuda_ipc \
        --out benchmarks/results/hop-latency-DATE.json

Between two GPUs (the peer on `--peer-device`, e.g. cuda:1), ``nccl`` is a transport too
(NCCL refuses two ranks on one GPU):

    python -m benchmarks.hop_latency --device cuda:0 --peer-device cuda:1 \
        --transports tcp,cuda_ipc,nccl

A message of activations [rows, hidden] goes from this process to a peer process over the
transport and straight back over a second link of the same kind (the peer forwards it as
a stage forwards what it receives: on its device). One hop = half the round trip, from the
send of a tensor already on the device to the tensor on the other side's device
(`torch.cuda.synchronize` after the receive); over ``tcp`` that includes the copy to the host
and the upload, as a stage pays them. Per size: p50 and p99 over `--rounds` messages after
`--warmup`. Sizes default to the llama3-8b shape's decode activations at batch 1 and 256,
and a 4,096-token prefill step.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import git_revision, print_table, write_json
from stage_worker.dataplane import TcpListener, TcpTransport, new_link_token
from stage_worker.dataplane.transport import LinkListener, Transport

HOST = "127.0.0.1"
END = 1 << 62
DEFAULT_SIZES = "1x4096,256x4096,4096x4096"


def _sizes(text: str) -> list[tuple[int, int]]:
    return [(int(r), int(h)) for r, h in (s.split("x") for s in text.split(","))]


def _slot_bytes(sizes: str) -> int:
    """A ring slot that holds the largest message (bf16) and its alignment."""
    return max(r * h for r, h in _sizes(sizes)) * 2 + (1 << 12)


def _listener(kind: str, token: bytes, device: torch.device, slot_bytes: int) -> LinkListener:
    if kind == "tcp":
        return TcpListener(HOST, token=token)
    if kind == "nccl":
        from stage_worker.dataplane.nccl_setup import NcclListener

        return NcclListener(HOST, token=token, device=device)
    from stage_worker.dataplane.cuda_ipc_setup import CudaIpcListener
    from stage_worker.dataplane.cuda_ipc_slots import RingConfig

    return CudaIpcListener(HOST, token=token, ring=RingConfig(device, slot_bytes, slots=4))


def _connect(kind: str, port: int, token: bytes, device: torch.device) -> Transport:
    if kind == "tcp":
        return TcpTransport.connect(HOST, port, token=token, timeout_s=60)
    if kind == "nccl":
        from stage_worker.dataplane import nccl_setup

        return nccl_setup.connect(HOST, port, token=token, timeout_s=60, device=device)
    from stage_worker.dataplane.cuda_ipc_setup import connect

    return connect(HOST, port, token=token, timeout_s=60, device=device)


def peer(kind: str, port: int, token: bytes, device: torch.device, slot_bytes: int) -> None:
    """The other stage: accept the forward link (its port on stdout), connect the return
    link, forward every message on its device until END."""
    with _listener(kind, token, device, slot_bytes) as listener:
        print(listener.spec.port, flush=True)
        forward = listener.accept(120)
    back = _connect(kind, port, token, device)
    while True:
        step, tensors = forward.recv_any()
        if step == END:
            break
        back.send(step, [t.to(device) for t in tensors])
    back.close()
    forward.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(kind: str, device: torch.device, sizes: str, rounds: int,
            warmup: int, peer_device: torch.device | None = None) -> list[dict[str, Any]]:
    """`kind`'s hops between this process on `device` and a peer process on `peer_device`
    (default: `device`)."""
    token = new_link_token()
    with _listener(kind, token, device, _slot_bytes(sizes)) as back_listener:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.hop_latency", "--peer", kind,
             str(back_listener.spec.port), token.hex(), "--device", str(peer_device or device),
             "--sizes", sizes],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert proc.stdout is not None
        forward = _connect(kind, int(proc.stdout.readline()), token, device)
        back = back_listener.accept(120)
    rows, step = [], 0
    for n_rows, hidden in _sizes(sizes):
        x = torch.randn(n_rows, hidden, device=device).to(torch.bfloat16)
        hops = []
        for i in range(warmup + rounds):
            _sync(device)
            start = time.perf_counter()
            forward.send(step, [x])
            (got,) = back.recv(step)
            got = got.to(device)
            _sync(device)
            if i >= warmup:
                hops.append((time.perf_counter() - start) / 2)
            step += 1
        if not torch.equal(got, x):
            raise AssertionError(f"{kind}: the message came back changed")
        hops.sort()
        rows.append({"transport": kind, "peer": str(peer_device or device),
                     "activations": f"[{n_rows}, {hidden}] bf16",
                     "kb": round(x.numel() * 2 / 1024, 1),
                     "hop_ms_p50": 1e3 * statistics.median(hops),
                     "hop_ms_p99": 1e3 * hops[int(0.99 * (len(hops) - 1))]})
        print(rows[-1], flush=True)
    forward.send(END, [])
    proc.wait(60)
    forward.close()
    back.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", nargs=3, metavar=("KIND", "PORT", "TOKEN"), help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peer-device", default=None,
                    help="the peer process's device (default: --device)")
    ap.add_argument("--transports", default="tcp,cuda_ipc", help="of tcp, cuda_ipc, nccl")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="ROWSxHIDDEN,... (bf16)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/hop-latency-{dt.date.today()}.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.peer:
        kind, port, token = args.peer
        peer(kind, int(port), bytes.fromhex(token), device, _slot_bytes(args.sizes))
        return
    peer_device = torch.device(args.peer_device) if args.peer_device else device
    config = {"benchmark": "per-hop latency, device to device, half a round trip",
              "host": "two processes, loopback", "device": str(device),
              "peer_device": str(peer_device),
              "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "rounds": args.rounds, "warmup": args.warmup, "revision": git_revision()}
    print(config, flush=True)
    rows = [row for kind in args.transports.split(",")
            for row in measure(kind, device, args.sizes, args.rounds, args.warmup,
                               peer_device)]
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
