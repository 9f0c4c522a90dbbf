"""The cost of TLS on a TCP data-plane link: two processes on loopback, the same messages
over a plain and a TLS link, in one run.

    python -m benchmarks.dataplane_link --out benchmarks/results/dataplane-tls-DATE.json

Per message size (the activations of a decode step of W6, W3 and W4, and of a 4,096-token
prefill step of the 8B shape): the round trip of one message echoed back (p50 / p99), and
the rate of a stream of messages one way (MB/s, the last one acknowledged). Certificates
are made for the run (a CA and a certificate for 127.0.0.1: `tests.tls_certs`).
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

from benchmarks.report import git_revision, print_table, write_json
from stage_worker.dataplane import DataPlaneConfig, TcpListener, TcpTransport, new_link_token
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


def peer(port: int, token: str, certs: str) -> None:
    """The other process: echo each message, except SINK ones (kept; the one with ACK too
    is answered with an empty message); END stops."""
    link = TcpTransport.connect(HOST, port, token=bytes.fromhex(token), timeout_s=30,
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


def measure(certs: Path | None, rounds: int, stream_mb: float) -> list[dict[str, Any]]:
    token = new_link_token()
    config = _config(certs)
    with TcpListener(HOST, token=token, config=config) as listener:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.dataplane_link", "--peer",
                                 str(listener.address[1]), token.hex(), str(certs or "")],
                                env={**os.environ, "PYTHONPATH": os.getcwd()})
        link = listener.accept(60)
    rows = []
    step = 0
    for name, (rows_, hidden, dtype) in SIZES.items():
        x = torch.randn(rows_, hidden).to(dtype)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            link.send(step, [x])
            link.recv(step)
            times.append(time.perf_counter() - start)
            step += 1
        # One way: n messages the peer keeps, the last one acknowledged.
        n = max(4, int(stream_mb * 2**20 / (x.numel() * x.element_size())))
        start = time.perf_counter()
        for k in range(n):
            link.send(SINK | (ACK if k == n - 1 else 0) | (step + k), [x])
        link.recv(SINK | ACK | (step + n - 1))
        elapsed = time.perf_counter() - start
        step += n
        mb = x.numel() * x.element_size() / 2**20
        rows.append({"message": name, "tls": certs is not None, "mb": round(mb, 3),
                     "rtt_ms_p50": 1e3 * statistics.median(times),
                     "rtt_ms_p99": 1e3 * sorted(times)[int(0.99 * (len(times) - 1))],
                     "stream_mb_s": n * mb / elapsed})
    link.send(END, [])
    proc.wait(30)
    link.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", nargs=3, metavar=("PORT", "TOKEN", "CERTS"), help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=50, help="echoed messages per size")
    ap.add_argument("--stream-mb", type=float, default=256.0, help="MB streamed per size")
    ap.add_argument("--out", type=Path,
                    default=Path(f"benchmarks/results/dataplane-tls-{dt.date.today()}.json"))
    args = ap.parse_args()
    if args.peer:
        peer(int(args.peer[0]), args.peer[1], args.peer[2])
        return
    config = {"benchmark": "data-plane link, plain TCP against TLS", "host": "loopback, two "
              "processes", "rounds": args.rounds, "stream_mb": args.stream_mb,
              "tls": "TLS 1.3 (Python ssl, OpenSSL), ECDSA P-256 certificate",
              "revision": git_revision()}
    print(config, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        certs = _write_certs(Path(tmp))
        rows = measure(None, args.rounds, args.stream_mb) + measure(certs, args.rounds,
                                                                      args.stream_mb)
    write_json(args.out, config, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
