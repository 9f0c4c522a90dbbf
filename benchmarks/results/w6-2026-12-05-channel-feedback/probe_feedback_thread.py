"""CPU per message of the first stage's feedback thread (`FeedbackInbox`), from its
/proc ticks: a sender process sends a run-ahead feedback message (32 sequence ids, 32
tokens) every 1.4 ms (a W6 step) over a real TCP link. Run it from each revision's tree.

    PYTHONPATH=. python benchmarks/results/w6-2026-12-05-channel-feedback/probe_feedback_thread.py
"""

import multiprocessing as mp
import os
import threading
import time

import torch

from stage_worker.dataplane.tcp import TcpListener, TcpTransport
from stage_worker.feedback import FeedbackInbox, FeedbackStore

N, PERIOD = 5000, 0.0014


def sender(port: int, token: bytes) -> None:
    link = TcpTransport.connect("127.0.0.1", port, token=token, timeout_s=10)
    seq_ids = torch.arange(1000, 1032)
    tokens = torch.arange(32)
    time.sleep(0.3)
    for step in range(N):
        link.send(step, [seq_ids, tokens])  # the same message either revision's stage sends
        until = time.perf_counter() + PERIOD
        while time.perf_counter() < until:
            pass
    time.sleep(0.3)


def ticks(tid: int) -> tuple[int, int]:
    with open(f"/proc/{os.getpid()}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def main() -> None:
    token = os.urandom(32)
    listener = TcpListener("127.0.0.1", 0, token=token)
    proc = mp.Process(target=sender, args=(listener.address[1], token))
    proc.start()
    store = FeedbackStore()
    FeedbackInbox(store).attach(listener.accept(10))
    time.sleep(1.0)
    tid = next(t for t in threading.enumerate() if t.name == "feedback-recv").native_id
    assert tid is not None
    (user0, sys0), first = ticks(tid), store._newest
    time.sleep(5)
    (user1, sys1), n = ticks(tid), store._newest - first
    hz = os.sysconf("SC_CLK_TCK")
    print(f"{n} messages: user {(user1 - user0) / hz / n * 1e6:.1f} us, "
          f"system {(sys1 - sys0) / hz / n * 1e6:.1f} us per message")
    proc.join()


if __name__ == "__main__":
    main()
