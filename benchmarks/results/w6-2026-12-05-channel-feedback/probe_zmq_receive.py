"""CPU per message of a ZeroMQ PULL socket read on a uvloop event loop: through
`router.core.channel._Inbox` (the loop watches the socket's FD) against `zmq.asyncio`.
A sender process pushes 600-byte messages about 0.6 ms apart (a W6 front gets one a step).

    PYTHONPATH=. python benchmarks/results/w6-2026-12-05-channel-feedback/probe_zmq_receive.py
"""

import multiprocessing as mp
import os
import time

import uvloop
import zmq
import zmq.asyncio

N, PERIOD = 4000, 0.0006


def sender(address: str) -> None:
    sock = zmq.Context().socket(zmq.PUSH)
    sock.connect(address)
    payload = os.urandom(600)
    time.sleep(0.5)
    for _ in range(N):
        sock.send(payload)
        until = time.perf_counter() + PERIOD
        while time.perf_counter() < until:
            pass
    sock.send(b"end")
    time.sleep(0.2)


async def main(kind: str) -> None:
    address = f"ipc:///tmp/probe-zmq-{os.getpid()}-{kind}"
    if kind == "inbox":
        from router.core.channel import _Inbox
        recv = _Inbox(zmq.Context(), address).recv
    else:
        sock = zmq.asyncio.Context().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(address)
        recv = sock.recv
    proc = mp.Process(target=sender, args=(address,))
    proc.start()
    await recv()
    n, cpu0 = 0, time.process_time()
    while (await recv()) != b"end":
        n += 1
    print(kind, n, "messages,", round((time.process_time() - cpu0) / n * 1e6, 1),
          "us of CPU per message")
    proc.join()


if __name__ == "__main__":
    for kind in ("inbox", "zmq.asyncio", "inbox", "zmq.asyncio"):
        uvloop.run(main(kind))
