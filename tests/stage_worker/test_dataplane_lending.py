"""Lent receive buffers (`Transport.lend_buffers`): a byte-stream link writes a message into
the tensors of the `depth`-th message before it of the same layout, never earlier; other
layouts, large messages and links that do not lend allocate anew; a stage lends its
upstream link's activations for two steps."""

from __future__ import annotations

import pytest
import torch

from stage_worker.dataplane import TcpTransport
from stage_worker.dataplane.transport import LENT_MAX_BYTES
from stage_worker.links import LENT_STEPS, DataPlaneAddress, DataPlaneLinks
from tests.stage_worker.dataplane_helpers import HOST, TOKEN


def _exchange(link: tuple[TcpTransport, TcpTransport], step: int,
              tensor: torch.Tensor) -> torch.Tensor:
    sender, receiver = link
    sender.send(step, [tensor])
    (got,) = receiver.recv(step, timeout_s=5)
    return got


def test_without_lending_every_message_gets_its_own_memory(
        link: tuple[TcpTransport, TcpTransport]) -> None:
    got = [_exchange(link, step, torch.full((4, 8), float(step))) for step in range(4)]
    assert len({t.data_ptr() for t in got}) == 4
    for step, t in enumerate(got):
        assert torch.equal(t, torch.full((4, 8), float(step)))


def test_a_lent_message_is_written_over_by_the_depth_th_one_after_it(
        link: tuple[TcpTransport, TcpTransport]) -> None:
    link[1].lend_buffers(2)
    got = [_exchange(link, step, torch.full((4, 8), float(step))) for step in range(5)]
    ptrs = [t.data_ptr() for t in got]
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[4] == ptrs[0]
    assert ptrs[0] != ptrs[1]
    # The last two messages are intact; the older ones were written over, as lent.
    assert torch.equal(got[3], torch.full((4, 8), 3.0))
    assert torch.equal(got[4], torch.full((4, 8), 4.0))
    assert torch.equal(got[0], torch.full((4, 8), 4.0))


def test_another_layout_or_a_large_message_gets_new_memory(
        link: tuple[TcpTransport, TcpTransport]) -> None:
    link[1].lend_buffers(1)
    first = _exchange(link, 0, torch.ones(4, 8))
    other = _exchange(link, 1, torch.ones(2, 8))  # another layout: the turn restarts
    again = _exchange(link, 2, torch.full((2, 8), 2.0))
    assert other.data_ptr() != first.data_ptr() and again.data_ptr() == other.data_ptr()
    assert torch.equal(first, torch.ones(4, 8))  # the old layout's memory is left alone
    rows = LENT_MAX_BYTES // (8 * 4) + 1  # just over the limit: never lent
    big = [_exchange(link, step, torch.full((rows, 8), float(step))) for step in (3, 4)]
    assert big[0].data_ptr() != big[1].data_ptr()
    assert torch.equal(big[0], torch.full((rows, 8), 3.0))
    assert torch.equal(big[1], torch.full((rows, 8), 4.0))


def test_an_int64_message_is_never_lent(link: tuple[TcpTransport, TcpTransport]) -> None:
    sender, receiver = link
    receiver.lend_buffers(1)
    got = []
    for step in range(3):
        sender.send_ints(step, [[step, step + 1]])
        got.append(receiver.recv_ints(timeout_s=5)[1][0])
    assert [list(g) for g in got] == [[0, 1], [1, 2], [2, 3]]


def test_depth_must_be_positive(link: tuple[TcpTransport, TcpTransport]) -> None:
    with pytest.raises(ValueError, match="depth must be at least 1, got 0"):
        link[1].lend_buffers(0)


def test_a_stage_lends_its_upstream_activations_for_two_steps() -> None:
    upstream = DataPlaneLinks(DataPlaneAddress(), 5.0)
    downstream = DataPlaneLinks(DataPlaneAddress(), 5.0)
    try:
        address = upstream.listen_upstream(HOST, TOKEN, 0)
        downstream.connect_downstream(address, TOKEN, 0)
        got = []
        for step in range(LENT_STEPS + 1):
            downstream.send(step, [torch.full((3, 5), float(step))])
            (tensor,) = upstream.recv(step)
            got.append(tensor)
        assert got[LENT_STEPS].data_ptr() == got[0].data_ptr()
        assert len({t.data_ptr() for t in got[:LENT_STEPS]}) == LENT_STEPS
        assert torch.equal(got[LENT_STEPS], torch.full((3, 5), float(LENT_STEPS)))
    finally:
        upstream.close()
        downstream.close()
