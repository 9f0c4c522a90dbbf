"""The ``cuda_ipc`` transport: its descriptor and slot layout (CPU, exact), what a stage
offers, and (on the GPU) two real processes linked over CUDA IPC: bit-exact in order, a
slow receiver never overwritten, a killed peer seen, a wrong token refused."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from stage_worker.dataplane import LinkRefusedError, ProtocolError, StepMismatchError
from stage_worker.dataplane.config import TransportKind, new_link_token
from stage_worker.dataplane.cuda_ipc import unavailable_reason
from stage_worker.dataplane.cuda_ipc_setup import CudaIpcListener, connect
from stage_worker.dataplane.cuda_ipc_slots import (
    ENTRY_WIDTH,
    TENSOR_ALIGN,
    RingConfig,
    decode_descriptor,
    encode_descriptor,
    layout,
)
from stage_worker.dataplane.wire import DTYPE_CODES, MAX_NDIM
from stage_worker.links import offered_transports, ring_config
from tests.stage_worker.dataplane_helpers import HOST, REPO, as_bytes, call_within, random_bits

# --- CPU: the descriptor, the layout, the offer -------------------------------------------


def test_layout_aligns_every_tensor_and_refuses_what_does_not_fit() -> None:
    tensors = [torch.zeros(3, dtype=torch.uint8), torch.zeros(2, 5, dtype=torch.float32),
               torch.zeros(0, 7, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64)]
    entries = layout(tensors, 1 << 12)
    assert [e.offset for e in entries] == [0, 256, 512, 512]
    assert [e.nbytes for e in entries] == [3, 40, 0, 8]
    assert all(e.offset % TENSOR_ALIGN == 0 for e in entries)
    assert layout(tensors, 520) == entries
    with pytest.raises(ValueError, match="520 bytes does not fit the cuda_ipc slot of 519"):
        layout(tensors, 519)
    with pytest.raises(ValueError, match="float64"):
        layout([torch.zeros(1, dtype=torch.float64)], 1 << 12)
    with pytest.raises(ValueError, match="9 dims"):
        layout([torch.zeros([1] * 9)], 1 << 12)
    with pytest.raises(ValueError, match="65 tensors"):
        layout([torch.zeros(1)] * 65, 1 << 20)


def test_descriptor_round_trips() -> None:
    tensors = [torch.zeros(4, 576, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.float32),
               torch.zeros((), dtype=torch.int64), torch.zeros([1] * MAX_NDIM, dtype=torch.bool)]
    entries = layout(tensors, 1 << 16)
    desc = encode_descriptor(3, entries)
    assert desc.dtype == torch.int64 and desc.numel() == 2 + ENTRY_WIDTH * len(entries)
    assert decode_descriptor([desc], slots=4, slot_bytes=1 << 16) == (3, entries)
    assert decode_descriptor([encode_descriptor(0, [])], 1, 1) == (0, [])


def _desc(values: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(values, dtype=torch.int64)]


_ENTRY = [DTYPE_CODES[torch.float32], 1, 0, 4] + [0] * (MAX_NDIM - 1)  # float32[4] at 0


@pytest.mark.parametrize("desc", [
    [],  # no descriptor at all
    [torch.zeros(2 + ENTRY_WIDTH, dtype=torch.int32)],  # not int64
    _desc([0]),  # too short
    _desc([0, 2, *_ENTRY]),  # count says 2, one entry
    _desc([4, 1, *_ENTRY]),  # slot 4 of 4
    _desc([-1, 1, *_ENTRY]),  # negative slot
    _desc([0, 1, 99, *_ENTRY[1:]]),  # unknown dtype code
    _desc([0, 1, _ENTRY[0], 9, *_ENTRY[2:]]),  # ndim 9
    _desc([0, 1, *_ENTRY[:3], -4, *_ENTRY[4:]]),  # negative dim
    _desc([0, 1, *_ENTRY[:2], 100, *_ENTRY[3:]]),  # misaligned offset
    _desc([0, 1, *_ENTRY[:2], 1024, *_ENTRY[3:]]),  # past the slot's end
    _desc([0, 1, *_ENTRY[:3], 1 << 40, *_ENTRY[4:]]),  # a huge tensor
], ids=lambda d: "x")
def test_bad_descriptors_are_protocol_errors(desc: list[torch.Tensor]) -> None:
    with pytest.raises(ProtocolError):
        decode_descriptor(desc, slots=4, slot_bytes=1024)


def test_a_cpu_stage_offers_no_cuda_ipc_and_refuses_it_when_asked() -> None:
    cpu = torch.device("cpu")
    assert "not a CUDA device" in (unavailable_reason(cpu) or "")
    ring = ring_config(cpu, 2048, 576, torch.float32)
    assert ring is None
    assert offered_transports("auto", ring) == (TransportKind.TCP, TransportKind.UNIX)
    assert offered_transports("tcp", ring) == (TransportKind.TCP,)
    with pytest.raises(ValueError, match="cuda_ipc needs a CUDA device"):
        offered_transports("cuda_ipc", ring)
    with pytest.raises(ValueError, match="CUDA device"):
        RingConfig(cpu, 1024)


def test_a_ring_holds_the_largest_step_in_every_form() -> None:
    gpu = torch.device("cuda", 0)  # a RingConfig is sizes only: no CUDA call here
    assert RingConfig(gpu, 1).total_bytes == 2 << 20  # IPC shares 2 MiB-aligned memory
    slot = 4096 * 4096 * 2 + 64 * TENSOR_ALIGN
    assert offered_transports("auto", RingConfig(gpu, slot)) == (
        TransportKind.TCP, TransportKind.UNIX, TransportKind.CUDA_IPC)
    t, h = 4096, 4096
    for form in ([torch.zeros(t, h, dtype=torch.bfloat16)],  # as computed
                 [torch.zeros(t, h, dtype=torch.int8),  # int8 + a scale per 64 channels
                  torch.zeros(t, h // 64, dtype=torch.float32)]):
        layout(form, slot)  # fits


# --- GPU: two processes ---------------------------------------------------------------------

TOKEN = new_link_token()
SLOTS = 2
BURST = 3 * SLOTS

# The sending stage in its own process: "all" sends every dtype (one CUDA tensor, one CPU
# tensor, one strided CUDA view per message), then a burst of BURST messages faster than
# the receiver reads, then a message for step 200; it waits for a line on stdin before it
# closes. "one" sends one message, then sleeps (to be killed).
_PEER = """
import sys, time, torch
from stage_worker.dataplane.cuda_ipc_setup import connect
from stage_worker.dataplane.wire import DTYPE_CODES
from tests.stage_worker.dataplane_helpers import random_bits
host, port, token, mode = sys.argv[1:5]
link = connect(host, int(port), token=bytes.fromhex(token), timeout_s=60,
               device=torch.device("cuda", 0))
if mode == "one":
    link.send(5, [torch.arange(4, dtype=torch.int32, device="cuda")])
    torch.cuda.synchronize()
    time.sleep(120)
for i, dtype in enumerate(DTYPE_CODES):
    x = random_bits((37, 64), dtype, seed=i).cuda()
    link.send(i, [x, random_bits((3,), dtype, seed=100 + i), x[:, ::3]])
for k in range(int(sys.argv[5])):
    link.send(100 + k, [torch.full((1 << 14,), k, dtype=torch.int32, device="cuda")])
link.send(200, [torch.ones(1, device="cuda")])
sys.stdin.readline()
link.close()
"""


@contextlib.contextmanager
def _peer(listener: CudaIpcListener, mode: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", _PEER, HOST, str(listener.spec.port),
                             TOKEN.hex(), mode, str(BURST)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdin=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _listener() -> CudaIpcListener:
    return CudaIpcListener(HOST, token=TOKEN, ring=RingConfig(torch.device("cuda", 0),
                                                              slot_bytes=1 << 16, slots=SLOTS))


@pytest.mark.gpu
def test_two_processes_bit_exact_in_order_and_a_slow_receiver_never_overwritten() -> None:
    with _listener() as listener, _peer(listener, "all") as proc:
        receiver = listener.accept(120)
        for i, dtype in enumerate(DTYPE_CODES):
            x = random_bits((37, 64), dtype, seed=i)
            sent = [x, random_bits((3,), dtype, seed=100 + i), x[:, ::3]]
            got = receiver.recv(i, timeout_s=60)
            assert [g.device.type for g in got] == ["cuda"] * 3
            assert [(g.dtype, g.shape) for g in got] == [(s.dtype, s.shape) for s in sent]
            assert [as_bytes(g.cpu()) for g in got] == [as_bytes(s) for s in sent]
        time.sleep(2.0)  # the sender fills every slot and waits for credits
        for k in range(BURST):
            (got,) = receiver.recv(100 + k, timeout_s=30)
            assert torch.equal(got.cpu(), torch.full((1 << 14,), k, dtype=torch.int32)), k
        with pytest.raises(StepMismatchError, match="expected step 201, received step 200"):
            receiver.recv(201, timeout_s=30)
        assert proc.stdin is not None
        proc.stdin.write(b"done\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
        receiver.close()


@pytest.mark.gpu
def test_a_killed_sender_ends_the_link() -> None:
    with _listener() as listener, _peer(listener, "one") as proc:
        receiver = listener.accept(120)
        assert receiver.recv(5, timeout_s=60)[0].tolist() == [0, 1, 2, 3]
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(Exception) as info:
            call_within(15, lambda: receiver.recv(6))
        assert "closed" in str(info.value) or "EOF" in str(info.value)


@pytest.mark.gpu
def test_a_wrong_token_is_refused_and_one_process_cannot_map_its_own_ring() -> None:
    with _listener() as listener:
        spec = listener.spec
        box: dict[str, object] = {}
        thread = threading.Thread(target=lambda: box.update(r=_accept_quietly(listener)))
        thread.start()
        with pytest.raises(LinkRefusedError, match="refused the link token"):
            connect(spec.host, spec.port, token=new_link_token(), timeout_s=10,
                    device=torch.device("cuda", 0))
        # CUDA IPC maps memory of another process only: the stage's own ring is refused
        # with a clear error (the router then links the hop over tcp).
        with pytest.raises(LinkRefusedError, match="cannot map the peer's cuda_ipc ring"):
            connect(spec.host, spec.port, token=TOKEN, timeout_s=30,
                    device=torch.device("cuda", 0))
        thread.join(60)
        assert isinstance(box["r"], Exception)  # the listener set up no link


def _accept_quietly(listener: CudaIpcListener) -> object:
    try:
        return listener.accept(8)
    except Exception as e:  # no peer completed the set-up
        return e
