"""The data-plane transport of each hop, on the router's side: which one `choose_transport`
picks from two stages' Describe answers, how the answers and the Connect requests carry it,
the `--transport` flag through the configs and `stagemesh serve`, and the pipeline driver
linking over it against fake stages (real grpc.aio servers on 127.0.0.1 whose Connect
records what it was asked and refuses what the test says): with "auto", a hop whose cuda_ipc
link the stages refuse is linked over TCP. The reporting of a real mesh (GetStats,
GetModelInfo) is asserted in `test_engine_inprocess`."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import pytest

from protos.stagemesh.stage.v1 import stage_pb2 as pb
from protos.stagemesh.stage.v1 import stage_pb2_grpc
from router.config import RouterConfig
from router.core.config import CoreConfig
from router.main import core_config
from router.pipeline import Pipeline, PipelineError, StageInfo
from router.pipeline.convert import connect_request, info_from_describe, listen_request
from router.pipeline.driver import START_RETRY_S
from router.pipeline.shape import check_shape
from router.pipeline.transports import (
    choose_transport,
    describe_hops,
)
from stagemesh.cli import build_parser
from stagemesh.cli_services import router_config
from stagemesh.launcher import build_children
from tests.default_model import default_model_dir

HOST_A, HOST_B = "a:boot-1", "b:boot-2"


def _info(index: int, transports: tuple[str, ...] = ("tcp", "cuda_ipc"),
          host_id: str = HOST_A, num_stages: int = 2) -> StageInfo:
    return StageInfo(stage_index=index, num_stages=num_stages, layer_start=index,
                     layer_end=index + 1, device="cuda:0", dtype="bfloat16", tp_size=1,
                     num_kv_blocks=64, block_size=16, vocab_size=100,
                     max_num_batched_tokens=256, max_num_seqs=8, model_impl="null",
                     transports=transports, host_id=host_id)


# --- choose_transport ------------------------------------------------------------------------

TCP_ONLY = ("tcp",)
ALL = ("tcp", "cuda_ipc", "nccl")
NO_IPC = ("tcp", "nccl")
CPU = ("tcp", "unix")


@pytest.mark.parametrize(("up", "down", "wanted", "want"), [
    (_info(0), _info(1), "auto", "cuda_ipc"),
    (_info(0), _info(1, host_id=HOST_B), "auto", "tcp"),
    (_info(0, TCP_ONLY), _info(1), "auto", "tcp"),
    (_info(0), _info(1, TCP_ONLY), "auto", "tcp"),
    (_info(0, host_id=""), _info(1, host_id=""), "auto", "tcp"),  # hosts unknown
    (_info(0), _info(1), "tcp", "tcp"),
    (_info(0, TCP_ONLY), _info(1, host_id=HOST_B), "tcp", "tcp"),
    (_info(0), _info(1), "cuda_ipc", "cuda_ipc"),
    (_info(0, ALL), _info(1, ALL), "auto", "cuda_ipc"),
    (_info(0, ALL), _info(1, ALL, HOST_B), "auto", "nccl"),
    (_info(0, NO_IPC), _info(1, ALL, HOST_B), "auto", "nccl"),
    (_info(0, ALL), _info(1, TCP_ONLY, HOST_B), "auto", "tcp"),
    (_info(0, NO_IPC), _info(1, NO_IPC), "auto", "tcp"),
    (_info(0, ALL, ""), _info(1, ALL, ""), "auto", "tcp"),
    (_info(0, ALL), _info(1, ALL), "nccl", "nccl"),
    (_info(0, NO_IPC), _info(1, ("nccl",), HOST_B), "nccl", "nccl"),
    (_info(0, ALL), _info(1, ALL, HOST_B), "tcp", "tcp"),
], ids=["auto-same-host", "auto-other-host", "auto-up-lacks", "auto-down-lacks",
        "auto-no-host-id", "tcp", "tcp-whatever-offered", "cuda_ipc",
        "auto-same-host-all", "auto-other-host-nccl", "auto-other-host-nccl-no-ipc",
        "auto-other-host-down-lacks-nccl", "auto-same-host-no-ipc", "auto-no-host-id-all",
        "nccl-same-host", "nccl-other-host", "tcp-over-nccl"])
def test_the_transport_chosen_for_a_hop(up: StageInfo, down: StageInfo, wanted: str,
                                        want: str) -> None:
    assert choose_transport(up, down, wanted) == want


@pytest.mark.parametrize(("up", "down", "error"), [
    (_info(1, num_stages=3), _info(2, TCP_ONLY, num_stages=3),
     "the hop from stage 1 to stage 2 cannot use cuda_ipc: stage 2 does not offer it (it "
     "offers tcp)"),
    (_info(0, TCP_ONLY), _info(1, TCP_ONLY),
     "stage 0 does not offer it (it offers tcp); stage 1 does not offer it (it offers tcp)"),
    (_info(0), _info(1, host_id=HOST_B),
     "the hop from stage 0 to stage 1 cannot use cuda_ipc: they run on different hosts "
     "('a:boot-1' and 'b:boot-2')"),
    (_info(0, host_id=""), _info(1),
     "cannot use cuda_ipc: stage 0 does not report its host"),
], ids=["down-lacks", "both-lack", "other-hosts", "no-host-id"])
def test_cuda_ipc_forced_where_a_hop_cannot_have_it_names_the_stage(
        up: StageInfo, down: StageInfo, error: str) -> None:
    with pytest.raises(PipelineError, match=re.escape(error)):
        choose_transport(up, down, "cuda_ipc")


@pytest.mark.parametrize(("up", "down", "error"), [
    (_info(0, ALL), _info(1), "the hop from stage 0 to stage 1 cannot use nccl: stage 1 does "
     "not offer it (it offers tcp, cuda_ipc)"),
    (_info(2, TCP_ONLY, num_stages=4), _info(3, TCP_ONLY, HOST_B, num_stages=4),
     "--transport nccl: the hop from stage 2 to stage 3 cannot use nccl: stage 2 does not "
     "offer it (it offers tcp); stage 3 does not offer it (it offers tcp)"),
], ids=["down-lacks", "both-lack"])
def test_nccl_forced_where_a_hop_cannot_have_it_names_the_stage(
        up: StageInfo, down: StageInfo, error: str) -> None:
    with pytest.raises(PipelineError, match=re.escape(error)):
        choose_transport(up, down, "nccl")


def test_an_unknown_transport_is_refused() -> None:
    with pytest.raises(ValueError, match="got 'udp'"):
        choose_transport(_info(0), _info(1), "udp")
    with pytest.raises(ValueError, match="got 'udp'"):
        Pipeline(["127.0.0.1:1"], transport="udp")
    with pytest.raises(ValueError, match="got 'udp'"):
        RouterConfig(model_dir=Path("m"), model_name="m", stage_addresses=(), transport="udp")


def test_hops_in_the_ready_line() -> None:
    assert describe_hops([]) == "no hops"
    assert describe_hops(["tcp", "tcp"]) == "hops: tcp"
    assert describe_hops(["cuda_ipc", "tcp"]) == "hops: 0->1 cuda_ipc, 1->2 tcp"
    assert describe_hops(["cuda_ipc", "nccl"]) == "hops: 0->1 cuda_ipc, 1->2 nccl"


# --- protos ----------------------------------------------------------------------------------


def test_describe_maps_transports_and_host_and_an_old_stage_offers_tcp() -> None:
    new = info_from_describe(pb.DescribeResponse(
        stage_index=1, num_stages=2, transports=[pb.TRANSPORT_TCP, pb.TRANSPORT_CUDA_IPC],
        host_id=HOST_A))
    assert (new.transports, new.host_id) == (("tcp", "cuda_ipc"), HOST_A)
    nccl = info_from_describe(pb.DescribeResponse(transports=[pb.TRANSPORT_NCCL]))
    assert nccl.transports == ("nccl",)
    old = info_from_describe(pb.DescribeResponse(stage_index=0, num_stages=2))
    assert (old.transports, old.host_id) == (("tcp",), "")
    assert info_from_describe(pb.DescribeResponse(device_id="GPU-1")).device_id == "GPU-1"


@pytest.mark.parametrize(("device_ids", "devices"), [
    (("GPU-a", "GPU-a", "GPU-a"), 1),  # three stages take turns on one GPU
    (("GPU-a", "GPU-b", "GPU-a"), 2),
    (("GPU-a", "GPU-b", "GPU-c"), 3),
    (("", "", ""), 3),  # none reported (older stages): each its own
    (("GPU-a", "", "GPU-a"), 2),
    (("cpu/h/0-1", "cpu/h/0-1", "cpu/h/0-1"), 1),  # three stages on one host's cores
    (("cpu/h/0", "cpu/h/1", "cpu/g/0"), 3),  # pinned to other cores, or on another host
])
def test_stages_that_report_one_device_count_once(device_ids: tuple[str, ...],
                                                        devices: int) -> None:
    infos = [replace(_info(i, num_stages=3), device_id=d) for i, d in enumerate(device_ids)]
    assert check_shape(infos).num_devices == devices


def test_listen_and_connect_requests_carry_the_transport() -> None:
    listen = listen_request(3, b"t", "10.0.0.2", "cuda_ipc")
    assert (listen.role, listen.transport, listen.address, listen.link_token, listen.epoch) \
        == (pb.LINK_ROLE_LISTEN_UPSTREAM, pb.TRANSPORT_CUDA_IPC, "10.0.0.2", b"t", 3)
    connect = connect_request(3, b"t", "10.0.0.2:7000", "tcp")
    assert (connect.role, connect.transport, connect.address) \
        == (pb.LINK_ROLE_CONNECT_DOWNSTREAM, pb.TRANSPORT_TCP, "10.0.0.2:7000")
    feedback = listen_request(3, b"t", "h", "tcp", feedback=True)
    assert (feedback.role, feedback.transport) == (pb.LINK_ROLE_LISTEN_FEEDBACK,
                                                   pb.TRANSPORT_TCP)
    assert connect_request(3, b"t", "h:1", "cuda_ipc", feedback=True).role \
        == pb.LINK_ROLE_CONNECT_FEEDBACK
    with pytest.raises(ValueError, match="unknown data-plane transport 'udp'"):
        connect_request(3, b"t", "h:1", "udp")


# --- the flag --------------------------------------------------------------------------------


def test_the_flag_reaches_the_core_and_serve_passes_it_to_router_and_stages(
        tmp_path: Path) -> None:
    model_dir = default_model_dir()
    parser = build_parser()
    args = parser.parse_args(["router", "--model", str(model_dir), "--transport", "tcp"])
    cfg = router_config(args, ("127.0.0.1:1",))
    assert cfg.transport == "tcp"
    core = core_config(cfg, "/tmp/x.sock")
    assert CoreConfig.from_json(core.to_json()).transport == "tcp"
    default = parser.parse_args(["router", "--model", str(model_dir)])
    assert router_config(default, ("127.0.0.1:1",)).transport == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["router", "--transport", "udp"])
    for command in ("router", "stage", "serve"):
        assert parser.parse_args([command, "--model", str(model_dir), "--transport",
                                  "nccl"]).transport == "nccl"
    serve = parser.parse_args(["serve", "--model", str(model_dir), "--device", "cpu",
                               "--stages", "2", "--transport", "cuda_ipc",
                               "--micro-batches", "1"])
    children = build_children(serve, tmp_path)
    assert [c.role for c in children] == ["stage 0", "stage 1", "router", "gateway"]
    for child in children[:3]:
        i = child.argv.index("--transport")
        assert child.argv[i + 1] == "cuda_ipc", child.role
        assert parser.parse_args(child.argv[3:]).transport == "cuda_ipc"  # after -m stagemesh
    router = parser.parse_args(children[2].argv[3:])
    assert router_config(router, ("127.0.0.1:1",)).micro_batches == 1
    assert core_config(router_config(router, ("127.0.0.1:1",)), "x").micro_batches == 1
    assert router_config(default, ("127.0.0.1:1",)).micro_batches == 0  # one per device


# --- the driver against fake stages ----------------------------------------------------------


@dataclass
class FakeStage(stage_pb2_grpc.StageServiceServicer):
    """Describes itself as `info`; Connect records (role, transport) and answers `refuse`'s
    status for a request of that (role, transport), else a listener address. Run streams
    stay open until the router closes them."""

    info: pb.DescribeResponse
    refuse: dict[tuple[int, int], grpc.StatusCode] = field(default_factory=dict)
    asked: list[tuple[str, str]] = field(default_factory=list)

    async def Describe(self, request: pb.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> pb.DescribeResponse:
        return self.info

    async def Connect(self, request: pb.ConnectRequest,
                      context: grpc.aio.ServicerContext) -> pb.ConnectResponse:
        self.asked.append((pb.LinkRole.Name(request.role).removeprefix("LINK_ROLE_"),
                           pb.Transport.Name(request.transport).removeprefix("TRANSPORT_")))
        code = self.refuse.get((request.role, request.transport))
        if code is not None:
            await context.abort(code, "the two processes cannot share GPU memory")
        return pb.ConnectResponse(address="127.0.0.1:9")

    async def Run(self, request_iterator: AsyncIterator[pb.StepPlans],
                  context: grpc.aio.ServicerContext) -> None:
        async for _ in request_iterator:
            pass

    async def Drain(self, request: pb.DrainRequest,
                    context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        return pb.DrainResponse()


def _describe(index: int, num_stages: int, host_id: str = HOST_A,
              transports: tuple[int, ...] = (pb.TRANSPORT_TCP, pb.TRANSPORT_CUDA_IPC)
              ) -> pb.DescribeResponse:
    return pb.DescribeResponse(
        stage_index=index, num_stages=num_stages, layer_start=index, layer_end=index + 1,
        device="cuda:0", dtype="bfloat16", tp_size=1, num_kv_blocks=64, block_size=16,
        vocab_size=100, max_num_batched_tokens=256, max_num_seqs=8, model_impl="null",
        transports=list(transports), host_id=host_id)


# A start budget of one retry interval makes one attempt (its error raised, no retry), whose
# calls to the stages still have up to that long to answer on a loaded machine (a budget of
# 0 gave them 50 ms, which a Describe over a fresh channel can miss).
ONE_ATTEMPT_S = START_RETRY_S


def _run(stages: list[FakeStage], transport: str, budget_s: float = 5.0) -> list[str]:
    """Start a Pipeline asking for `transport` over `stages` (each a real server on
    127.0.0.1); its hop_transports once up. Raises what start() raises."""
    async def body() -> list[str]:
        servers, addresses = [], []
        for stage in stages:
            server = grpc.aio.server()
            stage_pb2_grpc.add_StageServiceServicer_to_server(stage, server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
        pipeline = Pipeline(addresses, connect_timeout_s=5.0, transport=transport)
        try:
            await pipeline.start(budget_s)
            return pipeline.hop_transports
        finally:
            await pipeline.close()
            for server in servers:
                await server.stop(grace=None)

    return asyncio.run(body())


LISTEN_CUDA = (pb.LINK_ROLE_LISTEN_UPSTREAM, pb.TRANSPORT_CUDA_IPC)
CONNECT_CUDA = (pb.LINK_ROLE_CONNECT_DOWNSTREAM, pb.TRANSPORT_CUDA_IPC)
CONNECT_NCCL = (pb.LINK_ROLE_CONNECT_DOWNSTREAM, pb.TRANSPORT_NCCL)
ALL_ENUMS = (pb.TRANSPORT_TCP, pb.TRANSPORT_CUDA_IPC, pb.TRANSPORT_NCCL)
CPU_ENUMS = (pb.TRANSPORT_TCP, pb.TRANSPORT_UNIX)
LISTEN_UNIX = (pb.LINK_ROLE_LISTEN_UPSTREAM, pb.TRANSPORT_UNIX)
LISTEN_FEEDBACK_UNIX = (pb.LINK_ROLE_LISTEN_FEEDBACK, pb.TRANSPORT_UNIX)


def test_auto_links_cpu_stages_of_one_host_over_unix_feedback_too_and_falls_back_to_tcp(
        caplog: pytest.LogCaptureFixture) -> None:
    stages = [FakeStage(_describe(i, 2, HOST_A, CPU_ENUMS)) for i in range(2)]
    assert _run(stages, "auto") == ["unix"]
    assert stages[0].asked == [("CONNECT_DOWNSTREAM", "UNIX"), ("LISTEN_FEEDBACK", "UNIX")]
    assert stages[1].asked == [("LISTEN_UPSTREAM", "UNIX"), ("CONNECT_FEEDBACK", "UNIX")]
    # The abstract name out of reach (another network namespace): TCP, hop and feedback.
    stages = [FakeStage(_describe(0, 2, HOST_A, CPU_ENUMS),
                        {LISTEN_FEEDBACK_UNIX: grpc.StatusCode.UNAVAILABLE}),
              FakeStage(_describe(1, 2, HOST_A, CPU_ENUMS),
                        {LISTEN_UNIX: grpc.StatusCode.UNAVAILABLE})]
    with caplog.at_level(logging.INFO, "stagemesh.router"):
        assert _run(stages, "auto") == ["tcp"]
    assert stages[0].asked == [("CONNECT_DOWNSTREAM", "TCP"), ("LISTEN_FEEDBACK", "UNIX"),
                               ("LISTEN_FEEDBACK", "TCP")]
    assert stages[1].asked == [("LISTEN_UPSTREAM", "UNIX"), ("LISTEN_UPSTREAM", "TCP"),
                               ("CONNECT_FEEDBACK", "TCP")]
    assert "hop 0->1: the unix link failed (UNAVAILABLE" in caplog.text
    assert "feedback link: the unix link failed (UNAVAILABLE" in caplog.text
    stages = [FakeStage(_describe(i, 2, HOST_A, CPU_ENUMS)) for i in range(2)]
    assert _run(stages, "tcp") == ["tcp"]  # tcp asked: no unix anywhere
    assert stages[0].asked == [("CONNECT_DOWNSTREAM", "TCP"), ("LISTEN_FEEDBACK", "TCP")]


def test_auto_links_over_nccl_across_hosts_and_falls_back_to_tcp_when_it_fails(
        caplog: pytest.LogCaptureFixture) -> None:
    hosts = (HOST_A, HOST_A, HOST_B, HOST_B)
    stages = [FakeStage(_describe(i, 4, hosts[i], ALL_ENUMS)) for i in range(4)]
    with caplog.at_level(logging.INFO, "stagemesh.router"):
        assert _run(stages, "auto") == ["cuda_ipc", "nccl", "cuda_ipc"]
    assert stages[2].asked[0] == ("LISTEN_UPSTREAM", "NCCL")
    assert "hops: 0->1 cuda_ipc, 1->2 nccl, 2->3 cuda_ipc" in caplog.text
    stages = [FakeStage(_describe(0, 2, HOST_A, ALL_ENUMS),
                        {CONNECT_NCCL: grpc.StatusCode.UNAVAILABLE}),
              FakeStage(_describe(1, 2, HOST_B, ALL_ENUMS))]
    caplog.clear()
    with caplog.at_level(logging.INFO, "stagemesh.router"):
        assert _run(stages, "auto") == ["tcp"]
    assert stages[0].asked[:2] == [("CONNECT_DOWNSTREAM", "NCCL"), ("CONNECT_DOWNSTREAM", "TCP")]
    assert "hop 0->1: the nccl link failed (UNAVAILABLE" in caplog.text
    with pytest.raises(PipelineError, match="UNAVAILABLE"):  # forced: no fallback
        _run([FakeStage(_describe(0, 2, HOST_A, ALL_ENUMS),
                        {CONNECT_NCCL: grpc.StatusCode.UNAVAILABLE}),
              FakeStage(_describe(1, 2, HOST_B, ALL_ENUMS))], "nccl", budget_s=ONE_ATTEMPT_S)


def test_auto_links_over_cuda_ipc_where_both_offer_it_and_feedback_over_tcp(
        caplog: pytest.LogCaptureFixture) -> None:
    stages = [FakeStage(_describe(i, 3, HOST_B if i == 2 else HOST_A)) for i in range(3)]
    with caplog.at_level(logging.INFO, "stagemesh.router"):
        assert _run(stages, "auto") == ["cuda_ipc", "tcp"]  # stage 2 on another host
    assert stages[0].asked == [("CONNECT_DOWNSTREAM", "CUDA_IPC"), ("LISTEN_FEEDBACK", "TCP")]
    assert stages[1].asked == [("LISTEN_UPSTREAM", "CUDA_IPC"), ("CONNECT_DOWNSTREAM", "TCP")]
    assert stages[2].asked == [("LISTEN_UPSTREAM", "TCP"), ("CONNECT_FEEDBACK", "TCP")]
    assert "hops: 0->1 cuda_ipc, 1->2 tcp" in caplog.text


@pytest.mark.parametrize("refused", [
    {0: {CONNECT_CUDA: grpc.StatusCode.FAILED_PRECONDITION}},
    {0: {CONNECT_CUDA: grpc.StatusCode.UNAVAILABLE}},
    {1: {LISTEN_CUDA: grpc.StatusCode.UNAVAILABLE}},
], ids=["connect-failed-precondition", "connect-unavailable", "listen-unavailable"])
def test_auto_falls_back_to_tcp_for_a_hop_whose_cuda_ipc_link_is_refused(
        refused: dict[int, dict[tuple[int, int], grpc.StatusCode]],
        caplog: pytest.LogCaptureFixture) -> None:
    stages = [FakeStage(_describe(i, 2), refused.get(i, {})) for i in range(2)]
    with caplog.at_level(logging.INFO, "stagemesh.router"):
        assert _run(stages, "auto") == ["tcp"]
    connect_refused = 0 in refused
    assert stages[1].asked == [("LISTEN_UPSTREAM", "CUDA_IPC"), ("LISTEN_UPSTREAM", "TCP"),
                               ("CONNECT_FEEDBACK", "TCP")]
    assert stages[0].asked == [*([("CONNECT_DOWNSTREAM", "CUDA_IPC")] if connect_refused
                                 else []),
                               ("CONNECT_DOWNSTREAM", "TCP"), ("LISTEN_FEEDBACK", "TCP")]
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert re.fullmatch(r"hop 0->1: the cuda_ipc link failed \((FAILED_PRECONDITION|"
                        r"UNAVAILABLE): the two processes cannot share GPU memory\); "
                        r"linking it over tcp", warning.getMessage())
    assert "hops: tcp" in caplog.text


def test_no_fallback_when_cuda_ipc_is_forced_or_the_refusal_is_another_kind() -> None:
    def refusing(code: grpc.StatusCode) -> list[FakeStage]:
        return [FakeStage(_describe(0, 2), {CONNECT_CUDA: code}), FakeStage(_describe(1, 2))]

    with pytest.raises(PipelineError, match="FAILED_PRECONDITION: the two processes"):
        _run(refusing(grpc.StatusCode.FAILED_PRECONDITION), "cuda_ipc", budget_s=ONE_ATTEMPT_S)
    with pytest.raises(PipelineError, match="PERMISSION_DENIED: the two processes"):
        _run(refusing(grpc.StatusCode.PERMISSION_DENIED), "auto", budget_s=ONE_ATTEMPT_S)


def test_forced_cuda_ipc_across_hosts_never_comes_up_and_forced_tcp_never_asks() -> None:
    stages = [FakeStage(_describe(0, 2)), FakeStage(_describe(1, 2, HOST_B))]
    with pytest.raises(PipelineError, match=re.escape(
            "the hop from stage 0 to stage 1 cannot use cuda_ipc: they run on different "
            "hosts")):
        _run(stages, "cuda_ipc", budget_s=ONE_ATTEMPT_S)
    assert stages[0].asked == stages[1].asked == []  # refused before any link was asked for
    stages = [FakeStage(_describe(i, 2)) for i in range(2)]
    assert _run(stages, "tcp") == ["tcp"]
    assert stages[1].asked == [("LISTEN_UPSTREAM", "TCP"), ("CONNECT_FEEDBACK", "TCP")]
    one = [FakeStage(_describe(0, 1))]
    assert _run(one, "cuda_ipc") == [] and one[0].asked == []
