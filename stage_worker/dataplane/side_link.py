"""What ``cuda_ipc`` and ``nccl`` share: the plain TCP *side link* beside the GPU path (the
link's token, keepalive and close semantics; a wrong or stale token is refused by the
handshake before any set-up), its listener and connector, one-way ends, and credits: a
sender has at most as many messages in flight as credits, and the receiver returns each as a
side-link message with no tensors whose step id is the credit (a slot index, or 0).

The side link is plain even with data-plane TLS: credits flow back while data flows forward,
and a TLS link serialises its two directions. It carries step ids, shapes and handles, never
activations; the token still authenticates the peer.
"""

from __future__ import annotations

import abc
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import ClassVar, Generic, TypeVar

import torch

from stage_worker.dataplane.config import DataPlaneConfig, LinkSpec, TransportKind
from stage_worker.dataplane.tcp import TcpListener, TcpTransport
from stage_worker.dataplane.transport import (
    LinkClosedError,
    LinkListener,
    ProtocolError,
    Transport,
    TransportError,
    TransportTimeout,
)

logger = logging.getLogger(__name__)

NO_CUPY = "cupy is not installed (pip install 'stagemesh[gpu]')"
_CLOSED = -1  # the credit queue's "link closed" marker (never a credit)
EndT = TypeVar("EndT", bound=Transport)


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 1 ms (never "no bound")."""
    return max(deadline - time.monotonic(), 1e-3)


def raw_bytes(data: bytes) -> torch.Tensor:
    """uint8[len(data)], a copy of ``data`` (handles and ids travel raw, never pickled)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@functools.cache
def unavailable_reason(device: torch.device) -> str | None:
    """Why a GPU transport cannot run on ``device`` here (None: it can): not a CUDA device,
    or no CuPy (`NO_CUPY`: also the reason when a part of CuPy cannot be imported)."""
    if device.type != "cuda":
        return f"the stage runs on {device.type}, not a CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return NO_CUPY
    return None


def refuse_if_unavailable(kind: TransportKind, reason: str | None,
                          error: Callable[[str], Exception]) -> None:
    """Raise ``error("<kind> is not available here: <reason>")`` unless ``reason`` is None."""
    if reason is not None:
        raise error(f"{kind.value} is not available here: {reason}")


class SideLinkListener(LinkListener, Generic[EndT]):
    """A `TcpListener` for the side link (ValueError: malformed token; OSError: cannot
    bind); subclasses check their arguments, call this constructor, implement `_set_up`."""

    kind: ClassVar[TransportKind]

    def __init__(self, host: str, port: int, *, token: bytes, config: DataPlaneConfig) -> None:
        self._tcp = TcpListener(host, port, token=token, config=replace(config, tls=None))
        self._config = config

    @property
    def spec(self) -> LinkSpec:
        host, port = self._tcp.address
        return LinkSpec(self.kind, host, port, self._tcp.spec.token)

    def accept(self, timeout_s: float) -> EndT:
        """The next peer that presents the token and completes the set-up; a peer whose
        set-up fails (`TransportError`, `ValueError`) is closed, logged and skipped."""
        deadline = time.monotonic() + timeout_s
        while True:
            side = self._tcp.accept(time_left(deadline))
            try:
                return self._set_up(side, deadline)
            except (TransportError, ValueError) as e:
                side.close()
                logger.warning("%s peer %s dropped during set-up: %s", self.kind.value,
                               side.peer, e)
                if time.monotonic() >= deadline:
                    raise TransportTimeout(f"no {self.kind.value} peer set up within "
                                           f"{timeout_s}s", link_closed=False) from e

    @abc.abstractmethod
    def _set_up(self, side: TcpTransport, deadline: float) -> EndT:
        """This end of the set-up, on an authenticated side link, by ``deadline``."""

    def close(self) -> None:
        self._tcp.close()


def connect_side(host: str, port: int, *, token: bytes, timeout_s: float,
                 config: DataPlaneConfig, set_up: Callable[[TcpTransport, float], EndT]
                 ) -> EndT:
    """Connect the side link and present the token (errors as `TcpTransport.connect`), then
    return ``set_up(side, deadline)``; the side link is closed if the set-up raises."""
    deadline = time.monotonic() + timeout_s
    side = TcpTransport.connect(host, port, token=token, timeout_s=timeout_s,
                                config=replace(config, tls=None))
    try:
        return set_up(side, deadline)
    except BaseException:
        side.close()
        raise


class SideLinkEnd(Transport):
    """One end of a one-way link: ``send`` and ``recv_any`` refuse until a sender overrides
    ``send``, a receiver ``recv_any``. ``close`` (idempotent, thread-safe) closes the side
    link (the peer sees EOF), then calls `_release` once; every ``close`` returns after it."""

    kind: ClassVar[TransportKind]
    _ARTICLE: ClassVar[str] = "a"  # "a cuda_ipc link", "an nccl link"

    def __init__(self, side: TcpTransport) -> None:
        self._side = side
        self.peer = side.peer
        self._close_lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed or self._side.closed

    def send(self, step_id: int, tensors: Sequence[torch.Tensor],
             timeout_s: float | None = None) -> None:
        raise self._one_way()

    def recv_any(self, timeout_s: float | None = None) -> tuple[int, list[torch.Tensor]]:
        raise self._one_way()

    def close(self) -> None:
        """Returns once the end is released, whichever thread closed it first."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._side.close()
            self._release()

    @abc.abstractmethod
    def _release(self) -> None:
        """Free what the GPU path holds (once, after the side link closed)."""

    def _closed_error(self) -> LinkClosedError:
        return LinkClosedError(f"{self.kind.value} link to {self.peer} is closed")

    def _raise_if_closed(self) -> None:
        if self.closed:
            raise self._closed_error()

    def _one_way(self) -> TransportError:
        return TransportError(f"{self._ARTICLE} {self.kind.value} link carries data from the "
                              "connector to the listener only")


class CreditedSender(SideLinkEnd):
    """The sending end, ``credits`` in hand. A send takes one (`_take_credit`); a thread
    reads those the receiver returns (anything but an initial credit with no tensors is a
    `ProtocolError`). When the side link ends the thread calls `_credits_ended`, then every
    send waiting for a credit raises `LinkClosedError`. Subclasses call this constructor,
    set themselves up, then call `_start_credit_reader`; sends hold ``_send_lock``."""

    _CREDIT_UNIT: ClassVar[str]  # what a credit names, in errors: "slot", "step"
    _STARVED: ClassVar[str]  # why a send timed out waiting for a credit

    def __init__(self, side: TcpTransport, credits: Sequence[int]) -> None:
        super().__init__(side)
        self._credits: queue.SimpleQueue[int] = queue.SimpleQueue()
        for credit in credits:
            self._credits.put(credit)
        self._valid_credits = frozenset(credits)
        self._send_lock = threading.Lock()

    def _start_credit_reader(self) -> None:
        name = f"{self.kind.value.replace('_', '-')}-credits"
        threading.Thread(target=self._read_credits, daemon=True, name=name).start()

    def _take_credit(self, step_id: int, deadline: float | None) -> int:
        """A free credit; blocks while all are in flight. Raises `TransportTimeout` (not
        ``link_closed``) at ``deadline``, `LinkClosedError` once the side link ended."""
        try:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            credit = self._credits.get(timeout=remaining)
        except queue.Empty:
            raise TransportTimeout(f"send of step {step_id} to {self.peer}: {self._STARVED} "
                                   "(the receiver is not reading)", link_closed=False) from None
        if credit == _CLOSED:
            self._credits.put(_CLOSED)  # for the next caller too
            raise self._closed_error()
        return credit

    def _read_credits(self) -> None:
        try:
            while True:
                credit, tensors = self._side.recv_any(None)
                if tensors or credit not in self._valid_credits:
                    raise ProtocolError(f"{self.kind.value} credit for {self._CREDIT_UNIT} "
                                        f"{credit} with {len(tensors)} tensors")
                self._credits.put(credit)
        except TransportError as e:
            if not self._closed:
                logger.info("%s link to %s ended: %s", self.kind.value, self.peer, e)
        finally:
            self._credits_ended()
            self._credits.put(_CLOSED)  # then wake a send waiting for a credit

    def _credits_ended(self) -> None:
        """Close the side link, not the end: `close` may wait for the send lock that a send
        waiting for a credit holds."""
        self._side.close()
