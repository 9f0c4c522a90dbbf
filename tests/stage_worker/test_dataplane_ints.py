"""Host integers on the data plane (the run-ahead feedback's message): `send_ints` and
`recv_ints` carry the same message as `send` of 1-D int64 tensors, over a real loopback
TCP link and through the `Transport` contract's defaults."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from stage_worker.dataplane import ProtocolError, TcpTransport, Transport
from tests.stage_worker.dataplane_helpers import assert_bit_exact

_INT64_EDGES = [-(1 << 63), -1, 0, 1, (1 << 63) - 1]


def test_ints_travel_as_the_int64_tensors_send_would_carry(
        link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = link
    columns = [list(range(5)), _INT64_EDGES, []]
    sender.send_ints(7, columns)
    step, got = receiver.recv_ints(timeout_s=5)
    assert (step, [list(c) for c in got]) == (7, columns)
    # The same bytes as `send` of int64 tensors, read either way.
    sender.send_ints(8, columns)
    assert_bit_exact([torch.tensor(c, dtype=torch.int64) for c in columns],
                     receiver.recv(8, timeout_s=5))
    sender.send(9, [torch.tensor(_INT64_EDGES), torch.zeros(0, dtype=torch.int64)])
    step, got = receiver.recv_ints(timeout_s=5)
    assert (step, [list(c) for c in got]) == (9, [_INT64_EDGES, []])


def test_ints_refuse_another_dtype_or_rank_and_close_the_link(
        link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = link
    sender.send(1, [torch.zeros(2, 2, dtype=torch.int64)])
    with pytest.raises(ProtocolError, match=r"1-D int64.*\[2, 2\]"):
        receiver.recv_ints(timeout_s=5)
    assert receiver.closed
    with pytest.raises(OverflowError):
        sender.send_ints(2, [[1 << 63]])


class _Queue(Transport):
    """A transport of one process's queue: what the contract's defaults build on."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, list[torch.Tensor]]] = []
        self._closed = False

    def send(self, step_id: int, tensors: Sequence[torch.Tensor],
             timeout_s: float | None = None) -> None:
        self.messages.append((step_id, [t.clone() for t in tensors]))

    def recv_any(self, timeout_s: float | None = None) -> tuple[int, list[torch.Tensor]]:
        return self.messages.pop(0)

    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed


def test_every_transport_carries_ints_through_its_tensors() -> None:
    link = _Queue()
    link.send_ints(3, [_INT64_EDGES, []])
    assert_bit_exact([torch.tensor(_INT64_EDGES), torch.zeros(0, dtype=torch.int64)],
                     link.messages[0][1])
    assert link.recv_ints() == (3, [_INT64_EDGES, []])
    with pytest.raises(OverflowError):
        link.send_ints(4, [[1 << 63]])
    link.send(4, [torch.zeros(3)])
    with pytest.raises(ProtocolError, match=r"tensor 0 is \[3\] torch\.float32"):
        link.recv_ints()
    assert link.closed
