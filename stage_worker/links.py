"""The stage's two data-plane ends (upstream listener, downstream connection), per epoch.

Thread-safe: `Connect` calls arrive on the gRPC worker thread while an accept runs in the
background; steps use the links from the same worker thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stage_worker.dataplane import (
    LinkListener,
    LinkSpec,
    Transport,
    TransportError,
    TransportKind,
    open_link,
    open_listener,
)

log = logging.getLogger("stagemesh.stage")

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})


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


class DataPlaneLinks:
    """The upstream and downstream links of one stage. A higher epoch (the router re-linked
    after a restart) drops the links of the previous one."""

    def __init__(self, address: DataPlaneAddress, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.epoch = -1
        self._listener: LinkListener | None = None
        self._upstream: Transport | None = None
        self._downstream: Transport | None = None
        self._upstream_ready = threading.Event()
        self._lock = threading.Lock()

    @property
    def has_upstream(self) -> bool:
        return self._upstream is not None

    @property
    def has_downstream(self) -> bool:
        return self._downstream is not None

    def listen_upstream(self, router_host: str, token: bytes, epoch: int) -> str:
        """Start listening for the upstream stage; returns the "host:port" it should dial.
        `router_host` is the host the router reaches this stage by (see `DataPlaneAddress`).
        Accepts in the background; a step waits for the link."""
        self._new_epoch(epoch)
        bind, advertise = self.address.resolve(router_host)
        with self._lock:  # a repeated LISTEN in one epoch replaces the listener (same port)
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        listener = open_listener(LinkSpec(TransportKind.TCP, bind, self.address.port, token))
        self._listener = listener
        self._upstream_ready.clear()
        threading.Thread(target=self._accept, args=(listener, epoch), daemon=True,
                         name="dataplane-accept").start()
        host = f"[{advertise}]" if ":" in advertise and not advertise.startswith("[") else advertise
        return f"{host}:{listener.spec.port}"

    def connect_downstream(self, address: str, token: bytes, epoch: int) -> None:
        self._new_epoch(epoch)
        host, _, port = address.rpartition(":")
        link = open_link(LinkSpec(TransportKind.TCP, host.strip("[]"), int(port), token),
                         timeout_s=self.timeout_s)
        with self._lock:
            if self._downstream is not None:
                self._downstream.close()
            self._downstream = link

    def recv(self, step_id: int) -> list[torch.Tensor]:
        """Step `step_id`'s tensors from upstream, waiting up to the timeout for the link."""
        if not self._upstream_ready.wait(self.timeout_s) or self._upstream is None:
            raise LinkNotReadyError(f"step {step_id}: upstream data-plane link not connected "
                                    f"within {self.timeout_s:.0f}s")
        return self._upstream.recv(step_id, timeout_s=self.timeout_s)

    def send(self, step_id: int, tensors: Sequence[torch.Tensor]) -> None:
        if self._downstream is None:
            raise LinkNotReadyError("no downstream data-plane link: router must Connect")
        self._downstream.send(step_id, tensors)

    def close(self) -> None:
        """Drop every link and the listener (the stage shuts down)."""
        self._new_epoch(self.epoch + 1)

    def _accept(self, listener: LinkListener, epoch: int) -> None:
        try:
            link = listener.accept(timeout_s=self.timeout_s)
        except (TransportError, OSError) as e:  # the step that needs the link reports it
            log.warning("upstream link (epoch %d) not accepted: %s", epoch, e)
            return
        with self._lock:
            if epoch != self.epoch:
                link.close()
                return
            if self._upstream is not None:
                self._upstream.close()
            self._upstream = link
        self._upstream_ready.set()

    def _new_epoch(self, epoch: int) -> None:
        """A higher epoch drops the links of the previous one (a stage restarted)."""
        with self._lock:
            if epoch <= self.epoch:
                return
            self.epoch = epoch
            for link in (self._upstream, self._downstream):
                if link is not None:
                    link.close()
            if self._listener is not None:
                self._listener.close()
            self._upstream = self._downstream = None
            self._listener = None
