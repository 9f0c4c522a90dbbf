"""The stage's data-plane ends, per epoch: the upstream listener, the downstream connection,
and the run-ahead feedback link (last stage -> first stage; see `stage_worker.feedback`).

Thread-safe: `Connect` calls arrive on the gRPC worker thread while an accept runs in the
background; steps use the links from the same worker thread.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stage_worker.dataplane import (
    DataPlaneConfig,
    LinkListener,
    LinkSpec,
    Transport,
    TransportError,
    TransportKind,
    open_link,
    open_listener,
)
from stage_worker.dataplane.cuda_ipc import unavailable_reason
from stage_worker.dataplane.cuda_ipc_slots import TENSOR_ALIGN, RingConfig
from stage_worker.dataplane.nccl_backend import unavailable_reason as nccl_unavailable_reason
from stage_worker.dataplane.unix import unavailable_reason as unix_unavailable_reason
from stage_worker.dataplane.wire import MAX_TENSORS

log = logging.getLogger("stagemesh.stage")

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})
# A step's activations are done with within the step (decompressed, handed to the runner,
# broadcast to the TP ranks or uploaded from a pinned copy, or sent on by a middle stage's
# step): the upstream link writes the second step after them into their memory.
LENT_STEPS = 2


@dataclass(frozen=True)
class DataPlaneAddress:
    """Where this stage's data-plane listener binds and what it tells the upstream stage.

    bind_host: "" binds the host the router names in the LISTEN request.
    port: 0 picks a free port per listener; a fixed port is reused across re-links.
    advertise_host: "" advertises the bound host, or the router's name for this stage when
        the bound host is a wildcard.
    """

    bind_host: str = ""
    port: int = 0
    advertise_host: str = ""

    def resolve(self, router_host: str) -> tuple[str, str]:
        """(host to bind, host to advertise) for a LISTEN request naming `router_host`."""
        bind = (self.bind_host or router_host).strip("[]")
        if self.advertise_host:
            return bind, self.advertise_host
        return bind, (router_host if bind in WILDCARD_HOSTS else bind)


class LinkNotReadyError(RuntimeError):
    """A step arrived before the data-plane link it needs was connected."""


class _Inbound:
    """The listening end of one link: its listener and the link it accepted."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.listener: LinkListener | None = None
        self.link: Transport | None = None
        self.ready = threading.Event()

    def drop(self) -> None:
        for end in (self.link, self.listener):
            if end is not None:
                end.close()
        self.link = self.listener = None
        self.ready.clear()


class DataPlaneLinks:
    """The links of one stage: activations from upstream and to downstream, and the
    run-ahead feedback link (the last stage sends, the first listens). A higher epoch (the
    router re-linked after a restart) drops the links of the previous one.

    `on_feedback` is called with each feedback link the first stage accepts (it starts a
    thread that drains it). Activation links are ``tcp``, ``cuda_ipc`` where `ring` is
    given (the stage's device and its largest step's activations), or ``nccl`` where
    `nccl_device` is (the stage's device, with NCCL available), or ``unix`` (a stage of
    the same host, on Linux): the router names the kind per hop in ``Connect``. The
    feedback link (a few host integers) is ``tcp`` or ``unix``.
    """

    def __init__(self, address: DataPlaneAddress, timeout_s: float,
                 on_feedback: Callable[[Transport], None] | None = None,
                 ring: RingConfig | None = None,
                 config: DataPlaneConfig | None = None,
                 nccl_device: torch.device | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.ring = ring
        self.nccl_device = nccl_device
        self.config = config or DataPlaneConfig()  # limits, TLS
        self.upstream_kind: TransportKind | None = None  # of the links of this epoch
        self.downstream_kind: TransportKind | None = None
        self.epoch = -1
        self._upstream = _Inbound("upstream")
        self._feedback_in = _Inbound("feedback")
        self._downstream: Transport | None = None
        self._feedback_out: Transport | None = None
        self._on_feedback = on_feedback
        self._lock = threading.Lock()

    @property
    def has_upstream(self) -> bool:
        return self._upstream.link is not None

    @property
    def has_downstream(self) -> bool:
        return self._downstream is not None

    @property
    def has_feedback(self) -> bool:
        """Whether a feedback link is up (either end)."""
        return self._feedback_in.link is not None or self._feedback_out is not None

    def listen_upstream(self, router_host: str, token: bytes, epoch: int,
                        kind: TransportKind = TransportKind.TCP) -> str:
        """Start listening for the upstream stage; returns the "host:port" it should dial.
        `router_host` is the host the router reaches this stage by (see `DataPlaneAddress`).
        Accepts in the background; a step waits for the link."""
        address = self._listen(self._upstream, router_host, token, epoch, kind)
        self.upstream_kind = kind
        return address

    def listen_feedback(self, router_host: str, token: bytes, epoch: int,
                        kind: TransportKind = TransportKind.TCP) -> str:
        """First stage: listen for the last stage's feedback link (``tcp`` or ``unix``), as
        `listen_upstream` (the first stage has no upstream listener, so a fixed data-plane
        port serves it)."""
        return self._listen(self._feedback_in, router_host, token, epoch, kind)

    def connect_downstream(self, address: str, token: bytes, epoch: int,
                           kind: TransportKind = TransportKind.TCP) -> None:
        link = self._connect(address, token, epoch, kind)
        with self._lock:
            if self._downstream is not None:
                self._downstream.close()
            self._downstream = link
            self.downstream_kind = kind

    def connect_feedback(self, address: str, token: bytes, epoch: int,
                         kind: TransportKind = TransportKind.TCP) -> None:
        """Last stage: dial the first stage's feedback listener at `address`."""
        link = self._connect(address, token, epoch, kind)
        with self._lock:
            if self._feedback_out is not None:
                self._feedback_out.close()
            self._feedback_out = link

    def recv(self, step_id: int) -> list[torch.Tensor]:
        """Step `step_id`'s tensors from upstream, waiting up to the timeout for the link."""
        up = self._upstream
        if not up.ready.wait(self.timeout_s) or up.link is None:
            raise LinkNotReadyError(f"step {step_id}: upstream data-plane link not connected "
                                    f"within {self.timeout_s:.0f}s")
        return up.link.recv(step_id, timeout_s=self.timeout_s)

    def send(self, step_id: int, tensors: Sequence[torch.Tensor]) -> None:
        if self._downstream is None:
            raise LinkNotReadyError("no downstream data-plane link: router must Connect")
        self._downstream.send(step_id, tensors)

    def send_feedback(self, step_id: int, seq_ids: Sequence[int],
                      token_ids: Sequence[int]) -> None:
        """Last stage: step `step_id`'s sampled ids to the first stage (`feedback`'s
        message); nothing without a feedback link (the router links one for every pipeline
        of more than one stage)."""
        if self._feedback_out is not None:
            self._feedback_out.send_ints(step_id, [seq_ids, token_ids],
                                         timeout_s=self.timeout_s)

    def close_epoch(self, epoch: int) -> None:
        """Close the links of `epoch` if it is still the current one (a blocked receive on
        one of them ends at once); listeners stay until the next epoch replaces them."""
        with self._lock:
            if epoch != self.epoch:
                return
            for link in (self._downstream, self._feedback_out, self._upstream.link,
                         self._feedback_in.link):
                if link is not None:
                    link.close()
            self._downstream = self._feedback_out = None
            for inbound in (self._upstream, self._feedback_in):
                inbound.link = None
                inbound.ready.set()  # wakes a step waiting for the link: it finds none

    def close(self) -> None:
        """Drop every link and the listener (the stage shuts down)."""
        self._new_epoch(self.epoch + 1)

    def _listen(self, inbound: _Inbound, router_host: str, token: bytes, epoch: int,
                kind: TransportKind = TransportKind.TCP) -> str:
        self._new_epoch(epoch)
        bind, advertise = self.address.resolve(router_host)
        with self._lock:  # a repeated LISTEN in one epoch replaces the listener (same port)
            if inbound.listener is not None:
                inbound.listener.close()
                inbound.listener = None
        ring, device = self._ends_for(kind)
        listener = open_listener(LinkSpec(kind, bind, self.address.port, token),
                                 config=self.config, ring=ring, device=device)
        inbound.listener = listener
        inbound.ready.clear()
        threading.Thread(target=self._accept, args=(inbound, listener, epoch), daemon=True,
                         name=f"dataplane-accept-{inbound.name}").start()
        if kind is TransportKind.UNIX:
            return listener.spec.host  # "unix:@<name>"
        host = f"[{advertise}]" if ":" in advertise and not advertise.startswith("[") else advertise
        return f"{host}:{listener.spec.port}"

    def _connect(self, address: str, token: bytes, epoch: int,
                 kind: TransportKind = TransportKind.TCP) -> Transport:
        self._new_epoch(epoch)
        ring, device = self._ends_for(kind)
        if kind is TransportKind.UNIX:
            return open_link(LinkSpec(kind, address, 0, token), timeout_s=self.timeout_s,
                             config=self.config)
        host, _, port = address.rpartition(":")
        if ring is not None:
            device = ring.device
        return open_link(LinkSpec(kind, host.strip("[]"), int(port), token),
                         timeout_s=self.timeout_s, config=self.config, device=device)

    def _ends_for(self, kind: TransportKind) -> tuple[RingConfig | None, torch.device | None]:
        """(the ring a ``cuda_ipc`` link needs, the device an ``nccl`` link needs);
        ValueError where this stage offers no such link."""
        if kind is TransportKind.TCP or (kind is TransportKind.UNIX
                                         and unix_unavailable_reason() is None):
            return None, None
        if kind is TransportKind.CUDA_IPC and self.ring is not None:
            return self.ring, None
        if kind is TransportKind.NCCL and self.nccl_device is not None:
            return None, self.nccl_device
        raise ValueError(f"this stage does not offer the {kind.value} transport")

    def _accept(self, inbound: _Inbound, listener: LinkListener, epoch: int) -> None:
        try:
            link = listener.accept(timeout_s=self.timeout_s)
        except (TransportError, OSError) as e:  # the step that needs the link reports it
            log.warning("%s link (epoch %d) not accepted: %s", inbound.name, epoch, e)
            return
        with self._lock:
            if epoch != self.epoch:
                link.close()
                return
            if inbound.link is not None:
                inbound.link.close()
            inbound.link = link
        if inbound is self._feedback_in and self._on_feedback is not None:
            self._on_feedback(link)
        if inbound is self._upstream:
            link.lend_buffers(LENT_STEPS)
        inbound.ready.set()

    def _new_epoch(self, epoch: int) -> None:
        """A higher epoch drops the links of the previous one (a stage restarted)."""
        with self._lock:
            if epoch <= self.epoch:
                return
            self.epoch = epoch
            for link in (self._downstream, self._feedback_out):
                if link is not None:
                    link.close()
            self._downstream = self._feedback_out = None
            self._upstream.drop()
            self._feedback_in.drop()


def offered_transports(choice: str, ring: RingConfig | None,
                       nccl_device: torch.device | None = None) -> tuple[TransportKind, ...]:
    """What a stage configured with transport `choice` ("auto", "tcp", "unix", "cuda_ipc",
    "nccl") offers for activation links, given the `ring` it could receive into (None: no
    CUDA IPC here) and its `nccl_device` (None: no NCCL here; see `nccl_device`). "auto"
    offers ``unix`` wherever the platform has it (Linux); the router takes it only for a
    hop inside one host.

    Raises:
        ValueError: "unix", "cuda_ipc" or "nccl" was asked for where it cannot work.
    """
    if choice == "tcp":
        return (TransportKind.TCP,)
    unix = unix_unavailable_reason()
    if choice == "unix":
        if unix is not None:
            raise ValueError(f"--transport unix: {unix}")
        return (TransportKind.UNIX,)
    if choice == "cuda_ipc":
        if ring is None:
            raise ValueError("--transport cuda_ipc needs a CUDA device and cupy on the stage")
        return (TransportKind.CUDA_IPC,)
    if choice == "nccl":
        if nccl_device is None:
            raise ValueError("--transport nccl needs a CUDA device and cupy with NCCL on the "
                             "stage")
        return (TransportKind.NCCL,)
    return ((TransportKind.TCP,) + ((TransportKind.UNIX,) if unix is None else ())
            + ((TransportKind.CUDA_IPC,) if ring is not None else ())
            + ((TransportKind.NCCL,) if nccl_device is not None else ()))


def nccl_device(device: torch.device, choice: str, tls: bool) -> torch.device | None:
    """`device` where a stage configured with transport `choice` offers ``nccl`` on it,
    else None (logged where it could have). With data-plane TLS, "auto" does not offer it:
    NCCL does not encrypt, and a stage given TLS expects its activations encrypted between
    hosts ("nccl" asked for explicitly still offers it)."""
    if choice not in ("auto", "nccl"):
        return None
    if choice == "auto" and tls:
        log.info("data plane: nccl not offered under auto with data-plane TLS (NCCL does "
                 "not encrypt; --transport nccl offers it)")
        return None
    reason = nccl_unavailable_reason(device)
    if reason is not None:
        log.info("data plane: nccl not offered (%s)", reason)
        return None
    return device


def ring_config(device: torch.device, max_tokens: int, hidden_size: int,
                dtype: torch.dtype) -> RingConfig | None:
    """The ``cuda_ipc`` ring that holds a step's activations as the upstream stage sends
    them ([max_tokens, hidden] in `dtype`, or a smaller compressed form, with room for the
    per-tensor alignment); None where CUDA IPC is not available (a CPU stage, no cupy)."""
    reason = unavailable_reason(device)
    if reason is not None:
        log.info("data plane: cuda_ipc not offered (%s)", reason)
        return None
    return RingConfig(device,
                      max_tokens * hidden_size * dtype.itemsize + MAX_TENSORS * TENSOR_ALIGN)


@functools.cache
def host_id() -> str:
    """This machine, as Describe reports it: the host name and the kernel's boot id (two
    containers of one pod share both; two pods, or two hosts, differ)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@functools.cache
def device_id(device: str) -> str:
    """What `device` computes on, as Describe reports it (stages that report the same id take
    turns on it):
    - "cuda:N": the card's UUID, "GPU-...", the same in every process whatever
      CUDA_VISIBLE_DEVICES renumbers;
    - "cpu": the cores this process may run on, "cpu/<host_id>/<cpus>" (cpus as ranges, "0-3,8").
      Two CPU stages of one host with the same cores share them (torch's threads take every
      core the process may use), as two stages share one GPU; pinned to different cores
      (taskset, a cpuset), or on different hosts, they are different devices. The cores are
      the calling thread's mask, read once: a process that binds its threads to single
      cores (OMP_PROC_BIND and the like) before its first Describe reports one core."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"cpu/{host_id()}/{cpu_ranges(os.sched_getaffinity(0))}"
    return f"GPU-{torch.cuda.get_device_properties(dev).uuid}"


def cpu_ranges(cpus: Iterable[int]) -> str:
    """CPU numbers as sorted ranges: {0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
