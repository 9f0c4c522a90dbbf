"""Where the router links a hop, and the feedback link, over `unix` (`choose_transport`,
`choose_feedback_transport`): inside one host only, after cuda_ipc, unless tcp is asked
for."""

from __future__ import annotations

import pytest

from router.pipeline.shape import PipelineError, StageInfo
from router.pipeline.transports import choose_feedback_transport, choose_transport
from tests.router.test_pipeline_transports import CPU, HOST_B, TCP_ONLY, _info

GPU = ("tcp", "unix", "cuda_ipc", "nccl")


@pytest.mark.parametrize(("up", "down", "wanted", "want"), [
    (_info(0, CPU), _info(1, CPU), "auto", "unix"),
    (_info(0, GPU), _info(1, GPU), "auto", "cuda_ipc"),  # device to device first
    (_info(0, CPU), _info(1, CPU, HOST_B), "auto", "tcp"),
    (_info(0, GPU), _info(1, GPU, HOST_B), "auto", "nccl"),
    (_info(0, CPU, ""), _info(1, CPU, ""), "auto", "tcp"),  # hosts unknown
    (_info(0, CPU), _info(1, TCP_ONLY), "auto", "tcp"),
    (_info(0, CPU), _info(1, CPU), "tcp", "tcp"),
    (_info(0, GPU), _info(1, GPU), "unix", "unix"),
], ids=["cpu-one-host", "gpu-one-host", "cpu-two-hosts", "gpu-two-hosts", "hosts-unknown",
        "one-offers-tcp-only", "tcp-asked", "unix-asked"])
def test_unix_is_chosen_inside_one_host(up: StageInfo, down: StageInfo, wanted: str,
                                        want: str) -> None:
    assert choose_transport(up, down, wanted) == want


def test_unix_forced_where_a_hop_cannot_have_it_names_the_reason() -> None:
    with pytest.raises(PipelineError, match="different hosts"):
        choose_transport(_info(0, CPU), _info(1, CPU, HOST_B), "unix")
    with pytest.raises(PipelineError, match=r"stage 1 does not offer it \(it offers tcp\)"):
        choose_transport(_info(0, CPU), _info(1, TCP_ONLY), "unix")


@pytest.mark.parametrize(("last", "first", "wanted", "want"), [
    (_info(1, CPU), _info(0, CPU), "auto", "unix"),
    (_info(1, CPU), _info(0, CPU), "cuda_ipc", "unix"),  # whatever the hops, when it can
    (_info(1, CPU), _info(0, CPU), "tcp", "tcp"),
    (_info(1, CPU, HOST_B), _info(0, CPU), "auto", "tcp"),
    (_info(1, TCP_ONLY), _info(0, CPU), "auto", "tcp"),
], ids=["one-host", "other-hops-asked", "tcp-asked", "two-hosts", "one-offers-tcp-only"])
def test_the_feedback_link_is_unix_inside_one_host_unless_tcp_is_asked_for(
        last: StageInfo, first: StageInfo, wanted: str, want: str) -> None:
    assert choose_feedback_transport(last, first, wanted) == want
