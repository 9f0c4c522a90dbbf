"""The stage leader (TP rank 0): runs steps, fans plans out to the other TP ranks, and moves
activations over the data plane. Synchronous; the gRPC service calls it from a thread.

TP fan-out protocol, per step, over the TP group's control channel: one tagged message,
PLAN + the serialized plan, RESET (drop all state) or SHUTDOWN; after a plan, on a non-first
stage, the step's input activations broadcast from the leader (every rank needs them).
"""

from __future__ import annotations

import logging
import threading
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
from stage_worker.executor import StepExecutor
from stage_worker.parallel import TPGroup
from stage_worker.plan import StagePlan, StepOutcome

log = logging.getLogger("stagemesh.stage")

PLAN = b"P"  # followed by the serialized StepPlan (which may itself be empty bytes)
RESET = b"R"
SHUTDOWN = b"S"


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


class StageLeader:
    """Owns the executor of TP rank 0, the data-plane links and the TP fan-out."""

    def __init__(self, executor: StepExecutor, tp: TPGroup, step_timeout_s: float,
                 dataplane: DataPlaneAddress = DataPlaneAddress()) -> None:
        self.executor = executor
        self.tp = tp
        self.step_timeout_s = step_timeout_s
        self.dataplane = dataplane
        self.epoch = -1
        self._listener: LinkListener | None = None
        self._upstream: Transport | None = None
        self._downstream: Transport | None = None
        self._upstream_ready = threading.Event()
        self._lock = threading.Lock()

    # --- data-plane links -------------------------------------------------------------------

    def listen_upstream(self, router_host: str, token: bytes, epoch: int) -> str:
        """Start listening for the upstream stage; returns the "host:port" it should dial.
        `router_host` is the host the router reaches this stage by (see `DataPlaneAddress`).
        Accepts in the background; a step waits for the link."""
        self._new_epoch(epoch)
        bind, advertise = self.dataplane.resolve(router_host)
        with self._lock:  # a repeated LISTEN in one epoch replaces the listener (same port)
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        listener = open_listener(LinkSpec(TransportKind.TCP, bind, self.dataplane.port, token))
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
                         timeout_s=self.step_timeout_s)
        with self._lock:
            if self._downstream is not None:
                self._downstream.close()
            self._downstream = link

    def _accept(self, listener: LinkListener, epoch: int) -> None:
        try:
            link = listener.accept(timeout_s=self.step_timeout_s)
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

    @property
    def linked(self) -> bool:
        up_ok = self.executor.is_first or self._upstream is not None
        down_ok = self.executor.is_last or self._downstream is not None
        return up_ok and down_ok

    # --- steps ------------------------------------------------------------------------------

    def run_step(self, plan: StagePlan, plan_bytes: bytes | None) -> StepOutcome:
        """Execute one step on every TP rank; send activations on or sample.

        plan_bytes: the serialized plan for the other TP ranks (None when there are none).
        """
        if self.tp.size > 1:
            assert plan_bytes is not None, "a TP group needs the serialized plan"
            self.tp.broadcast_bytes(PLAN + plan_bytes)
        ex = self.executor
        chunks, ids = ex.prepare(plan)
        if ex.is_first:
            assert ids is not None
            inputs = ids
        else:
            inputs = self._recv(plan.step_id)
            if self.tp.size > 1 and chunks:
                inputs = self.tp.broadcast(inputs.to(ex.shape.device))
        out = ex.forward(chunks, inputs) if chunks else torch.empty(0)
        tokens = []
        if not ex.is_last:
            if self._downstream is None:
                raise LinkNotReadyError("no downstream data-plane link: router must Connect")
            self._downstream.send(plan.step_id, [out.cpu() if chunks else
                                                 torch.empty(0, ex.shape.hidden_size)])
        elif chunks:
            tokens = ex.sample(chunks, out)
        return StepOutcome(plan.step_id, tuple(tokens), ex.state.kv_blocks_used,
                           len(ex.state.seqs))

    def _recv(self, step_id: int) -> torch.Tensor:
        if not self._upstream_ready.wait(self.step_timeout_s) or self._upstream is None:
            raise LinkNotReadyError(f"step {step_id}: upstream data-plane link not connected "
                                    f"within {self.step_timeout_s:.0f}s")
        (hidden,) = self._upstream.recv(step_id, timeout_s=self.step_timeout_s)
        return hidden

    def reset(self) -> int:
        """Drop all sequence state on every rank (the Run stream ended)."""
        self.tp.broadcast_bytes(RESET)
        return self.executor.state.clear()

    def shutdown(self) -> None:
        self.tp.broadcast_bytes(SHUTDOWN)
        self._new_epoch(self.epoch + 1)
