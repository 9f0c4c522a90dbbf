"""Data-plane links between two processes of one host, in one run: plain TCP on loopback,
TCP with TLS, and a Unix-domain socket (`--links`, default all three).

    python -m benchmarks.dataplane_link --out benchmarks/results/dataplane-links-DATE.json

Per message size (the activations of a decode step of W6, W3 and W4, and of a 4,096-token
prefill step of the 8B shape): the round trip of one message echoed back (p50 / p99) and
the CPU it cost each process (this one sends and receives, the peer receives and echoes:
each end's CPU per message, thread and kernel time together), and the rate of a stream of
messages one way (MB/s, the last one acknowledged). Certificates are made for the run (a
CA and a certificate for 127.0.0.1: `tests.tls_certs`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import cpu_seconds, git_revision, print_table, write_json
from stage_worker.dataplane import (
    DataPlaneConfig,
    LinkListener,
    TcpListener,
    TcpTransport,
    Transport,
    new_link_token,
)
from stage_worker.dataplane import unix as unix_link
from stage_worker.dataplane.config import DataPlaneTls

HOST = "127.0.0.1"
SIZES = {  # name: (rows, hidden, dtype)
    "W6 decode [64, 576] fp32": (64, 576, torch.float32),
    "W3 decode [256, 576] bf16": (256, 576, torch.bfloat16),
    "W4 decode [256, 4096] bf16": (256, 4096, torch.bfloat16),
    "8B prefill [4096, 4096] bf16": (4096, 4096, torch.bfloat16),
}


def _config(certs: Path | None) -> DataPlaneConfig:
    if certs is None:
        return DataPlaneConfig()
    return DataPlaneConfig(tls=DataPlaneTls.load(certs / "cert.pem", certs / "key.pem",
                                                 certs / "ca.pem"))


SINK, ACK, END = 1 << 40, 1 << 41, 1 << 62  # step-id bits of the peer's protocol


LINKS = ("tcp", "tls", "unix")


def peer(address: str, token: str, certs: str) -> None:
    """The other process: dial `address` (a port, or "unix:@<name>"), echo each message,
    except SINK ones (kept; the one with ACK too is answered with an empty message); END
    stops."""
    link: Transport
    if address.startswith(unix_link.ADDRESS_PREFIX):
        link = unix_link.connect(address, token=bytes.fromhex(token), timeout_s=30)
    else:
        link = TcpTransport.connect(HOST, int(address), token=bytes.fromhex(token),
                                    timeout_s=30,
                                    config=_config(Path(certs) if certs else None))
    while True:
        step, tensors = link.recv_any()
        if step == END:
            return
        if not step & SINK:
            link.send(step, tensors)
        elif step & ACK:
            link.send(step, [])


def _write_certs(directory: Path) -> Path:
    from tests.tls_certs import write_pki

    pki = write_pki(directory)
    for name, src in (("cert.pem", pki.server_cert), ("key.pem", pki.server_key),
                      ("ca.pem", pki.ca)):
        (directory / name).write_bytes(src.read_bytes())
    return directory


def measure(kind: str, certs: Path | None, rounds: int,
            stream_mb: float) -> list[dict[str, Any]]:
    """The figures of one link `kind` ("tcp", "tls" with `certs`, "unix")."""
    token = new_link_token()
    config = _config(certs if kind == "tls" else None)
    listener: LinkListener
    if kind == "unix":
        listener = unix_link.UnixListener(token=token)
        address = listener.address
    else:
        listener = TcpListener(HOST, token=token, config=config)
        address = str(listener.address[1])
    with listener:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.dataplane_link", "--peer",
                                 address, token.hex(),
                                 str(certs or "") if kind == "tls" else ""],
                                env={**os.environ, "PYTHONPATH": os.getcwd()})
        link = listener.accept(60)
    rows = []
    step = 0
    for name, (rows_, hidden, dtype) in SIZES.items():
        x = torch.randn(rows_, hidden).to(dtype)
        times = []
        ours, theirs = time.process_time(), cpu_seconds(proc.pid)
        for _ in range(rounds):
            start = time.perf_counter()
            link.send(step, [x])
            link.recv(step)
            times.append(time.perf_counter() - start)
            step += 1
        ours, theirs = time.process_time() - ours, cpu_seconds(proc.pid) - theirs
        # One way: n messages the peer keeps, the last one acknowledged.
        n = max(4, int(stream_mb * 2**20 / (x.numel() * x.element_size())))
        start = time.perf_counter()
        for k in range(n):
            link.send(SINK | (ACK if k == n - 1 else 0) | (step + k), [x])
        link.recv(SINK | ACK | (step + n - 1))
        elapsed = time.perf_counter() - start
        step += n
        mb = x.numel() * x.element_size() / 2**20
        # Per message: each end sent one and received one per round trip.
        rows.append({"message": name, "link": kind, "mb": round(mb, 3),
                     "rtt_ms_p50": 1e3 * statistics.median(times),
                     "rtt_ms_p99": 1e3 * sorted(times)[int(0.99 * (len(times) - 1))],
                     "cpu_us_per_message_here": 1e6 * ours / (2 * rounds),
                     "cpu_us_per_message_peer": 1e6 * theirs / (2 * rounds),
                     "stream_mb_s": n * mb / elapsed})
    link.send(END, [])
    proc.wait(30)
    link.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", nargs=3, metavar=("ADDRESS", "TOKEN", "CERTS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--links", default=",".join(LINKS),
                    help=f"the links to measure, in order (of {', '.join(LINKS)})")
    ap.add_argument("--rounds", type=int, default=50, help="echoed messages per size")
    ap.add_argument("--stream-mb", type=float, default=256.0, help="MB streamed per size")
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/dataplane-links-{dt.date.today()}.json"))
    args = ap.parse_args()
    if args.peer:
        peer(args.peer[0], args.peer[1], args.peer[2])
        return
    links = args.links.split(",")
    if unknown := set(links) - set(LINKS):
        ap.error(f"unknown link(s) {', '.join(sorted(unknown))}: use {', '.join(LINKS)}")
    config = {"benchmark": "data-plane links: TCP, TCP with TLS, Unix-domain", "links": links,
              "host": "two processes of one host", "rounds": args.rounds,
              "stream_mb": args.stream_mb,
              "tls": "TLS 1.3 (Python ssl, OpenSSL), ECDSA P-256 certificate",
              "revision": git_revision()}
    print(config, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        certs = _write_certs(Path(tmp))
        rows = [row for kind in links
                for row in measure(kind, certs, args.rounds, args.stream_mb)]
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
