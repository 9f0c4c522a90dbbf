"""CPU per message of the core -> front hop: the channel's Unix-domain stream
(`router.core.channel`, this revision) against ZeroMQ PUSH/PULL read as the previous channel
read it (the loop watching the socket's FD; pyzmq must be installed: it is no longer a
dependency). The core's end sends a 32-sequence `StepOutputs` (about 600 bytes) every
0.6 ms, as a W6 front gets one a step; uvloop on both ends.

    PYTHONPATH=. python benchmarks/results/w6-2026-12-05-uds-channel/probe_channel.py
"""

import asyncio
import multiprocessing as mp
import os
import tempfile
import threading
import time
from array import array

import uvloop

from router.core.channel import CoreEndpoint, FrontEndpoint
from router.core.messages import Codec, StepOutputs

N, PERIOD = 4000, 0.0006
MSG = StepOutputs(array("q", range(32)).tobytes(), array("q", range(32)).tobytes(),
                  bytes(32), cached=[(i, 0, 0.0) for i in range(8)])


def _other_threads_cpu() -> float:
    """CPU seconds of this process's threads other than the calling one."""
    me, total = str(threading.get_native_id()), 0
    for tid in os.listdir("/proc/self/task"):
        if tid != me:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _report(kind: str, calls: float, others: float) -> None:
    print(f"{kind}: sender {calls / N * 1e6:.1f} us a message in send calls, "
          f"{others / N * 1e6:.1f} in its other threads", flush=True)


def _spin() -> None:
    until = time.perf_counter() + PERIOD
    while time.perf_counter() < until:
        pass


def core_sender(path: str) -> None:
    async def run() -> None:
        core = CoreEndpoint(path)
        await core.start()
        await core.receive()  # the front's Hello
        await asyncio.sleep(0.3)
        calls, others = 0.0, _other_threads_cpu()
        for _ in range(N):
            t = time.thread_time()
            core.send(0, MSG)
            calls += time.thread_time() - t
            _spin()
        _report("channel", calls, _other_threads_cpu() - others)
        await asyncio.sleep(0.3)
        core.close()
    uvloop.run(run())


def zmq_sender(address: str) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    data = Codec().encoder.encode(MSG)
    time.sleep(0.5)
    calls, others = 0.0, _other_threads_cpu()
    for _ in range(N):
        t = time.thread_time()
        sock.send(data)
        calls += time.thread_time() - t
        _spin()
    _report("zmq", calls, _other_threads_cpu() - others)
    time.sleep(0.3)


async def channel_receiver(path: str) -> None:
    front = FrontEndpoint(0, path)
    await front.receive()
    cpu0 = time.process_time()
    for _ in range(N - 1):
        await front.receive()
    print(f"channel: receiver {(time.process_time() - cpu0) / (N - 1) * 1e6:.1f} us of "
          "process CPU a message", flush=True)
    front.close()


async def zmq_receiver(address: str) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    fd, decoder, loop = sock.getsockopt(zmq.FD), Codec().core_decoder, asyncio.get_running_loop()

    async def recv() -> object:
        while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            woken = loop.create_future()
            loop.add_reader(fd, lambda f=woken: f.done() or f.set_result(None))
            try:
                await woken
            finally:
                loop.remove_reader(fd)
        return decoder.decode(sock.recv(zmq.NOBLOCK))

    await recv()
    cpu0 = time.process_time()
    for _ in range(N - 1):
        await recv()
    print(f"zmq: receiver {(time.process_time() - cpu0) / (N - 1) * 1e6:.1f} us of process "
          "CPU a message", flush=True)


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        for round_ in range(2):
            path = os.path.join(d, f"core{round_}.sock")
            sender = mp.Process(target=core_sender, args=(path,))
            sender.start()
            uvloop.run(channel_receiver(path))
            sender.join()
            address = f"ipc://{d}/zmq{round_}"
            sender = mp.Process(target=zmq_sender, args=(address,))
            sender.start()
            uvloop.run(zmq_receiver(address))
            sender.join()


if __name__ == "__main__":
    main()
