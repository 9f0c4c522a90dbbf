"""The byte format of data-plane links: a fixed binary header plus raw tensor bytes. No pickle.

Message (one per step), all header integers little-endian::

    prefix  20 bytes, struct "<4sBBHIQ"
        magic        4s   b"SMDP"
        version      u8   WIRE_VERSION (1)
        flags        u8   0 (reserved; non-zero is refused)
        count        u16  number of tensors, <= MAX_TENSORS (64)
        table_bytes  u32  length of the tensor table that follows, <= MAX_TABLE_BYTES
        step_id      u64  the step this message belongs to
    table   `count` entries, back to back
        dtype        u8   code from DTYPE_CODES (0 is never used)
        ndim         u8   <= MAX_NDIM (8); 0 for a scalar
        shape        u64 x ndim
        nbytes       u64  must equal prod(shape) * itemsize(dtype)
    payload `count` blobs in table order, each exactly `nbytes` long, no padding: the tensor's
            elements in C (row-major) order, raw, in the host byte order, which is
            little-endian on every platform we run (x86-64, aarch64). bfloat16 travels as its
            2-byte pattern, bool as one byte per element (0 or 1).

The receiver reads the prefix, then the table, checks every field and the total size against
its limit (so a bad peer cannot make it allocate more than ``max_message_bytes``), allocates
each tensor with ``torch.empty`` and receives its payload straight into the tensor's memory.

Handshake (TCP), before any message::

    connector -> listener   hello, struct "<4sBBH": magic b"SMHS", version u8 (1),
                            reserved u8 (0), token_len u16 (<= MAX_TOKEN_BYTES); then the token
    listener  -> connector  verdict, 4 bytes: b"SMOK" (accepted) or b"SMNO" (refused, and the
                            listener closes the connection)
"""

from __future__ import annotations

import functools
import math
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from stage_worker.dataplane.config import MAX_TOKEN_BYTES
from stage_worker.dataplane.transport import ProtocolError

MAGIC = b"SMDP"
WIRE_VERSION = 1
MAX_TENSORS = 64
MAX_NDIM = 8
MAX_STEP_ID = (1 << 64) - 1

PREFIX = struct.Struct("<4sBBHIQ")
_ENTRY_HEAD = struct.Struct("<BB")
_U64 = struct.Struct("<Q")
# dtype + ndim + shape + nbytes of the largest entry, times the most entries.
MAX_TABLE_BYTES = MAX_TENSORS * (_ENTRY_HEAD.size + 8 * MAX_NDIM + 8)

# The explicit wire table. Codes are part of the format: never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int64: 4,
    torch.int32: 5,
    torch.bool: 6,
    torch.uint8: 7,
    torch.int8: 8,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_INT64 = DTYPE_CODES[torch.int64]

HELLO_MAGIC = b"SMHS"
HELLO = struct.Struct("<4sBBH")
VERDICT_OK = b"SMOK"
VERDICT_REFUSED = b"SMNO"
VERDICT_BYTES = 4


@dataclass(frozen=True)
class TensorHeader:
    """One table entry: what the receiver allocates before the payload arrives."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


class Prefix(NamedTuple):
    """The fixed part of a message header (a NamedTuple: one is read per message)."""

    num_tensors: int
    table_bytes: int
    step_id: int


def wire_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as it travels: detached, on CPU, C-contiguous (a copy only where needed).

    Raises:
        ValueError: dtype not in the wire table, non-strided layout, or more than MAX_NDIM dims.
    """
    if tensor.dtype not in DTYPE_CODES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise ValueError(f"dtype {tensor.dtype} cannot travel on the data plane ({supported})")
    if tensor.layout != torch.strided:
        raise ValueError(f"only dense tensors travel on the data plane, got {tensor.layout}")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"tensor has {tensor.dim()} dims, the data plane allows {MAX_NDIM}")
    # Each step is skipped when it would be a no-op: this runs once per tensor per step.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat, writable byte view of a C-contiguous CPU tensor's memory (no copy).

    Exposed through numpy's buffer, cast to bytes; a bfloat16 tensor (numpy has no bfloat16)
    is reinterpreted as uint8 in torch first. The memoryview keeps the tensor alive.
    """
    if tensor.numel() == 0:
        return memoryview(bytearray())  # memoryview cannot cast zero-size shapes
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)  # a dtype view needs a dim to scale
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint8)
    return tensor.numpy().data.cast("B")


@functools.lru_cache(maxsize=512)
def _header_struct(ndims: tuple[int, ...]) -> struct.Struct:
    """Prefix + table layout for tensors of these ranks. "<" means no alignment padding."""
    return struct.Struct(PREFIX.format + "".join(f"BB{n}QQ" for n in ndims))


def encode_header(step_id: int, tensors: Sequence[torch.Tensor], max_message_bytes: int) -> bytes:
    """Prefix + table for ``tensors`` (already `wire_tensor`s), packed in one ``struct`` call.

    Raises:
        ValueError: step id out of range, too many tensors, or message over the size limit.
    """
    entries: list[int] = []
    payload = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries += [DTYPE_CODES[t.dtype], t.dim(), *t.shape, nbytes]
        payload += nbytes
    return _pack_header(step_id, tuple(t.dim() for t in tensors), entries, payload,
                        max_message_bytes)


def encode_int64_header(step_id: int, lengths: Sequence[int], max_message_bytes: int) -> bytes:
    """The header `encode_header` writes for 1-D int64 tensors of these `lengths`, without
    torch (host integers sent from `array`s: the run-ahead feedback).

    Raises:
        ValueError: as `encode_header`.
    """
    entries: list[int] = []
    for n in lengths:
        entries += [_INT64, 1, n, 8 * n]
    return _pack_header(step_id, (1,) * len(lengths), entries, 8 * sum(lengths),
                        max_message_bytes)


def _pack_header(step_id: int, ndims: tuple[int, ...], entries: list[int], payload: int,
                 max_message_bytes: int) -> bytes:
    """Prefix + table: `entries` are each tensor's dtype code, ndim, shape and nbytes.

    Raises:
        ValueError: step id out of range, too many tensors, or message over the size limit.
    """
    if not 0 <= step_id <= MAX_STEP_ID:
        raise ValueError(f"step_id must be in 0..2**64-1, got {step_id}")
    if len(ndims) > MAX_TENSORS:
        raise ValueError(f"{len(ndims)} tensors in one message, the limit is {MAX_TENSORS}")
    layout = _header_struct(ndims)
    if layout.size + payload > max_message_bytes:
        raise ValueError(
            f"message of {layout.size + payload} bytes exceeds the data-plane limit of "
            f"{max_message_bytes}"
        )
    table_bytes = layout.size - PREFIX.size
    return layout.pack(MAGIC, WIRE_VERSION, 0, len(ndims), table_bytes, step_id, *entries)


def decode_prefix(buf: bytes | bytearray | memoryview) -> Prefix:
    """Parse and bound-check the fixed prefix.

    Raises:
        ProtocolError: wrong magic or version, reserved flags set, too many tensors, or a
            table longer than MAX_TABLE_BYTES.
    """
    magic, version, flags, count, table_bytes, step_id = PREFIX.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad message magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise ProtocolError(f"wire version {version}, this end speaks {WIRE_VERSION}")
    if flags != 0:
        raise ProtocolError(f"reserved flags byte is {flags}, must be 0")
    if count > MAX_TENSORS:
        raise ProtocolError(f"message announces {count} tensors, the limit is {MAX_TENSORS}")
    if table_bytes > MAX_TABLE_BYTES:
        raise ProtocolError(
            f"tensor table of {table_bytes} bytes, the limit is {MAX_TABLE_BYTES}"
        )
    return Prefix(count, table_bytes, step_id)


def decode_table(
    buf: bytes | bytearray | memoryview, count: int, max_message_bytes: int
) -> tuple[TensorHeader, ...]:
    """Parse and bound-check ``count`` table entries filling all of ``buf``.

    Raises:
        ProtocolError: unknown dtype, too many dims, nbytes inconsistent with shape and
            dtype, table length wrong, or a total size over ``max_message_bytes``.
    """
    headers = []
    offset = 0
    total = PREFIX.size + len(buf)
    try:
        for i in range(count):
            code, ndim = _ENTRY_HEAD.unpack_from(buf, offset)
            offset += _ENTRY_HEAD.size
            dtype = _CODE_DTYPES.get(code)
            if dtype is None:
                raise ProtocolError(f"tensor {i}: unknown dtype code {code}")
            if ndim > MAX_NDIM:
                raise ProtocolError(f"tensor {i}: {ndim} dims, the limit is {MAX_NDIM}")
            shape = struct.unpack_from(f"<{ndim}Q", buf, offset)
            offset += 8 * ndim
            (nbytes,) = _U64.unpack_from(buf, offset)
            offset += 8
            # Checked before any multiplication result is used: an element count can never
            # exceed the byte limit, except in empty tensors, whose dims we bound the same way.
            if any(d > max_message_bytes for d in shape):
                raise ProtocolError(f"tensor {i}: dimension in {shape} exceeds the size limit")
            expected = math.prod(shape) * dtype.itemsize
            if nbytes != expected:
                raise ProtocolError(
                    f"tensor {i}: nbytes {nbytes} but shape {shape} of {dtype} is {expected}"
                )
            total += nbytes
            if total > max_message_bytes:
                raise ProtocolError(
                    f"message exceeds the data-plane limit of {max_message_bytes} bytes"
                )
            headers.append(TensorHeader(dtype=dtype, shape=tuple(shape), nbytes=nbytes))
    except struct.error as e:
        raise ProtocolError(f"tensor table truncated: {e}") from e
    if offset != len(buf):
        raise ProtocolError(f"tensor table is {len(buf)} bytes, its entries fill {offset}")
    return tuple(headers)


def encode_message(step_id: int, tensors: Sequence[torch.Tensor],
                   max_message_bytes: int) -> bytes:
    """One whole message (header + payload) in one buffer, for channels that move bytes
    rather than streams (the TP group's plan fan-out).

    Raises:
        ValueError: as `wire_tensor` and `encode_header`.
    """
    wire = [wire_tensor(t) for t in tensors]
    header = encode_header(step_id, wire, max_message_bytes)
    return b"".join([header, *(byte_view(t) for t in wire)])


def decode_message(buf: bytes, max_message_bytes: int) -> tuple[int, list[torch.Tensor]]:
    """(step id, tensors) of a buffer `encode_message` wrote; the tensors own their memory.

    Raises:
        ProtocolError: a bad header (as `decode_prefix`, `decode_table`) or a payload whose
            length is not what the table says.
    """
    if len(buf) < PREFIX.size:
        raise ProtocolError(f"message of {len(buf)} bytes is shorter than its prefix")
    prefix = decode_prefix(buf[:PREFIX.size])
    offset = PREFIX.size + prefix.table_bytes
    headers = decode_table(buf[PREFIX.size:offset], prefix.num_tensors, max_message_bytes)
    if offset + sum(h.nbytes for h in headers) != len(buf):
        raise ProtocolError(f"message of {len(buf)} bytes, its header describes "
                            f"{offset + sum(h.nbytes for h in headers)}")
    tensors = []
    for h in headers:
        t = torch.empty(h.shape, dtype=h.dtype)
        byte_view(t)[:] = buf[offset:offset + h.nbytes]
        offset += h.nbytes
        tensors.append(t)
    return prefix.step_id, tensors


def encode_hello(token: bytes) -> bytes:
    """The connector's handshake: hello struct followed by the token."""
    return HELLO.pack(HELLO_MAGIC, WIRE_VERSION, 0, len(token)) + token


def decode_hello(buf: bytes | bytearray | memoryview) -> int:
    """Check a hello struct and return the token length that follows.

    Raises:
        ProtocolError: wrong magic or version, or a token longer than MAX_TOKEN_BYTES.
    """
    magic, version, _reserved, token_len = HELLO.unpack(buf)
    if magic != HELLO_MAGIC:
        raise ProtocolError(f"bad hello magic {bytes(magic)!r}")
    if version != WIRE_VERSION:
        raise ProtocolError(f"hello version {version}, this end speaks {WIRE_VERSION}")
    if token_len > MAX_TOKEN_BYTES:
        raise ProtocolError(f"token of {token_len} bytes, the limit is {MAX_TOKEN_BYTES}")
    return int(token_len)


# A receive's payload allocators: from a payload's checked header, what it lands in and
# the writable bytes of that.


def tensor_payload(header: TensorHeader) -> tuple[torch.Tensor, memoryview]:
    """A tensor of the header's shape and dtype."""
    tensor = torch.empty(header.shape, dtype=header.dtype)
    return tensor, byte_view(tensor)


def int64_payload(header: TensorHeader) -> tuple[array[int], memoryview]:
    """An int64 array for a 1-D int64 payload (host byte order, as the wire's); anything
    else is a protocol error."""
    if header.dtype != torch.int64 or len(header.shape) != 1:
        raise ProtocolError(f"expected a 1-D int64 tensor, got {list(header.shape)} "
                            f"{header.dtype}")
    values = array("q", [0]) * header.shape[0]
    return values, memoryview(values).cast("B")
