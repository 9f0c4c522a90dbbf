"""The stage leader's data-plane links: where the listener binds, what it advertises, and
re-linking on a fixed port (as a service mesh or NetworkPolicy names it)."""

from __future__ import annotations

import time

import pytest

from foundation.ports import free_port
from stage_worker.build import build_stage_rank
from stage_worker.config import StageConfig
from stage_worker.leader import StageLeader
from stage_worker.links import DataPlaneAddress
from stage_worker.parallel import TPGroup
from tests.default_model import default_model_dir

TOKEN_A, TOKEN_B = b"a" * 32, b"b" * 32


@pytest.mark.parametrize(
    ("address", "router_host", "want"),
    [
        (DataPlaneAddress(), "10.0.0.7", ("10.0.0.7", "10.0.0.7")),
        (DataPlaneAddress("0.0.0.0"), "stage-1-0.stage-1", ("0.0.0.0", "stage-1-0.stage-1")),
        (DataPlaneAddress("::"), "stage-1-0.stage-1", ("::", "stage-1-0.stage-1")),
        (DataPlaneAddress("10.0.0.9"), "stage-1-0.stage-1", ("10.0.0.9", "10.0.0.9")),
        (DataPlaneAddress("0.0.0.0", 0, "dp.example"), "10.0.0.7", ("0.0.0.0", "dp.example")),
        (DataPlaneAddress(), "[::1]", ("::1", "::1")),
    ],
)
def test_bind_and_advertise_hosts(address: DataPlaneAddress, router_host: str,
                                  want: tuple[str, str]) -> None:
    assert address.resolve(router_host) == want


def _leader(stage_index: int, dataplane: DataPlaneAddress | None = None) -> StageLeader:
    cfg = StageConfig(default_model_dir(), stage_index=stage_index, num_stages=2,
                      model_impl="null")
    return StageLeader(build_stage_rank(cfg, TPGroup()), step_timeout_s=5.0,
                       dataplane=dataplane or DataPlaneAddress())


def _wait_linked(*leaders: StageLeader) -> None:
    deadline = time.monotonic() + 5
    while not all(leader.linked for leader in leaders):
        assert time.monotonic() < deadline, "data-plane link never came up"
        time.sleep(0.01)


def test_fixed_port_on_a_wildcard_advertises_the_router_name_and_survives_relinks() -> None:
    port = free_port()
    first, second = _leader(0), _leader(1, DataPlaneAddress("0.0.0.0", port))
    try:
        address = second.listen_upstream("127.0.0.1", TOKEN_A, epoch=0)
        assert address == f"127.0.0.1:{port}"
        first.connect_downstream(address, TOKEN_A, epoch=0)
        _wait_linked(first, second)

        # A re-link (a stage restarted): new epoch, new token, the same fixed port.
        assert second.listen_upstream("127.0.0.1", TOKEN_B, epoch=1) == address
        first.connect_downstream(address, TOKEN_B, epoch=1)
        _wait_linked(first, second)

        # The router retrying LISTEN within one epoch replaces the listener on that port.
        assert second.listen_upstream("127.0.0.1", TOKEN_B, epoch=1) == address
        first.connect_downstream(address, TOKEN_B, epoch=1)
        _wait_linked(first, second)
    finally:
        first.shutdown()
        second.shutdown()


def test_default_binds_the_router_host_on_any_port() -> None:
    first, second = _leader(0), _leader(1)
    try:
        address = second.listen_upstream("127.0.0.1", TOKEN_A, epoch=0)
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        first.connect_downstream(address, TOKEN_A, epoch=0)
        _wait_linked(first, second)
    finally:
        first.shutdown()
        second.shutdown()
