"""The slots of a ``cuda_ipc`` ring and the descriptor of a message in one (pure: no CUDA
call, tested on CPU). The transport itself is `stage_worker.dataplane.cuda_ipc`.

A message's tensors lie in its slot back to back, each at a 256-byte offset; the sender
names them in a descriptor, int64[2 + 11 * count]: the slot, the count, then per tensor its
dtype code (`wire.DTYPE_CODES`), ndim, byte offset and 8 dims. The receiver checks every
field against its ring before it reads a byte.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stage_worker.dataplane.transport import ProtocolError
from stage_worker.dataplane.wire import DTYPE_CODES, MAX_NDIM, MAX_TENSORS

TENSOR_ALIGN = 256  # byte offset of every tensor in a slot
RING_ALIGN = 2 << 20  # CUDA's advice: share only 2 MiB-aligned allocations over IPC
ENTRY_WIDTH = 3 + MAX_NDIM  # dtype code, ndim, offset, dims
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class RingConfig:
    """The receiver's ring: ``slots`` slots of ``slot_bytes`` each on ``device``.

    slot_bytes: the largest message the link carries (tensors laid out at 256-byte offsets);
        a stage sizes it from its largest step: max tokens x hidden size x element size.
    slots: messages in flight (sent, not yet copied out by the receiver).
    """

    device: torch.device
    slot_bytes: int
    slots: int = 4

    def __post_init__(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"a cuda_ipc ring lives on a CUDA device, not {self.device}")
        if self.slot_bytes <= 0 or self.slots <= 0:
            raise ValueError(f"slot_bytes and slots must be > 0, got {self.slot_bytes}, "
                             f"{self.slots}")

    @property
    def stride(self) -> int:
        """Bytes from one slot's start to the next (slots start 256-byte aligned)."""
        return _align(self.slot_bytes, TENSOR_ALIGN)

    @property
    def total_bytes(self) -> int:
        return _align(self.stride * self.slots, RING_ALIGN)


@dataclass(frozen=True)
class SlotEntry:
    """Where one tensor of a message lies in its slot."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def layout(tensors: Sequence[torch.Tensor], slot_bytes: int) -> list[SlotEntry]:
    """Each tensor's place in a slot, 256-byte aligned, in order.

    Raises:
        ValueError: too many tensors, a dtype the data plane does not carry, too many dims,
            or a message larger than a slot (nothing was sent; the link stays usable).
    """
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"{len(tensors)} tensors in one message, the data plane allows "
                         f"{MAX_TENSORS}")
    entries, offset = [], 0
    for t in tensors:
        if t.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {t.dtype} cannot travel on the data plane")
        if t.dim() > MAX_NDIM:
            raise ValueError(f"tensor has {t.dim()} dims, the data plane allows {MAX_NDIM}")
        entry = SlotEntry(t.dtype, tuple(t.shape), offset)
        entries.append(entry)
        offset = _align(offset + entry.nbytes, TENSOR_ALIGN)
    end = entries[-1].offset + entries[-1].nbytes if entries else 0
    if end > slot_bytes:
        raise ValueError(f"message of {end} bytes does not fit the cuda_ipc slot of "
                         f"{slot_bytes} bytes (the receiver sized it from its largest step)")
    return entries


def encode_descriptor(slot: int, entries: Sequence[SlotEntry]) -> torch.Tensor:
    """int64[2 + 11 * count]: slot, count, then each entry's dtype code, ndim, offset, dims."""
    values = [slot, len(entries)]
    for e in entries:
        dims = list(e.shape) + [0] * (MAX_NDIM - len(e.shape))
        values += [DTYPE_CODES[e.dtype], len(e.shape), e.offset, *dims]
    return torch.tensor(values, dtype=torch.int64)


def decode_descriptor(desc: Sequence[torch.Tensor], slots: int,
                      slot_bytes: int) -> tuple[int, list[SlotEntry]]:
    """The slot and entries of a data message, every field checked against the ring.

    Raises:
        ProtocolError: not a descriptor, or one pointing outside its slot.
    """
    if len(desc) != 1 or desc[0].dtype != torch.int64 or desc[0].dim() != 1:
        raise ProtocolError("cuda_ipc data message is not one int64 descriptor")
    values = desc[0].tolist()
    if len(values) < 2 or len(values) != 2 + ENTRY_WIDTH * values[1]:
        raise ProtocolError(f"cuda_ipc descriptor of {len(values)} values is malformed")
    slot, count = values[0], values[1]
    if not 0 <= slot < slots or count > MAX_TENSORS:
        raise ProtocolError(f"cuda_ipc descriptor names slot {slot} of {slots} and {count} "
                            "tensors")
    entries = []
    for i in range(count):
        code, ndim, offset, *dims = values[2 + i * ENTRY_WIDTH: 2 + (i + 1) * ENTRY_WIDTH]
        dtype = _CODE_DTYPES.get(code)
        if dtype is None or not 0 <= ndim <= MAX_NDIM or any(d < 0 for d in dims):
            raise ProtocolError(f"cuda_ipc descriptor entry {i}: dtype code {code}, ndim "
                                f"{ndim}, dims {dims}")
        entry = SlotEntry(dtype, tuple(dims[:ndim]), offset)
        if offset < 0 or offset % TENSOR_ALIGN or offset + entry.nbytes > slot_bytes:
            raise ProtocolError(f"cuda_ipc descriptor entry {i} ({entry.nbytes} bytes at "
                                f"{offset}) lies outside the {slot_bytes}-byte slot")
        entries.append(entry)
    return slot, entries
