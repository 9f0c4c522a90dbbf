"""Host <-> device copies that never make the host wait for the GPU, except where it must.

A step's small inputs (token ids, positions, block tables, sampling columns) are built on
the host. `upload` sends one to the device from pinned memory with `non_blocking=True`, so
the host goes on queueing the step while the copy runs (a plain `.to(cuda)` from pageable
memory, or `torch.tensor(list, device=cuda)`, waits for the stream). The caching host
allocator keeps a pinned block alive until the copies queued from it have run.

`HostCopy` goes the other way: device tensors copied into pinned host memory without
blocking, with one event; `wait()` is the step's one synchronisation with the GPU.

On CPU every call returns its tensors as they are (no copy), so the CPU path is the same
arithmetic on the same tensors.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`: a CPU tensor goes to a GPU from pinned memory, non-blocking; a
    tensor already on `device` (or any tensor on a CPU run) comes back as it is. The caller
    must not modify `host` afterwards."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device, non_blocking=True)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Overwrite `dst` (on any device) with `host`, a CPU tensor of its shape: to a GPU from
    pinned memory, non-blocking, as `upload`. The caller must not modify `host` afterwards."""
    if dst.device.type == "cuda" and host.device.type == "cpu":
        host = host.pin_memory()
    dst.copy_(host, non_blocking=True)


def write_ints(dst: torch.Tensor, values: Sequence[int]) -> None:
    """Overwrite `dst` [len(values)] (int64, on any device) with host integers: on CPU one
    NumPy write (a torch call after a stage's wait costs 10-20 µs, and a host tensor then a
    copy take three); to a GPU through `copy_into` from a host tensor."""
    if dst.is_cpu:
        dst.numpy()[:] = values
    else:
        copy_into(dst, host_tensor(values))


def to_device(values: Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (nested) list of numbers as a tensor on `device`, built on the host (see `upload`)."""
    return upload(host_tensor(values, dtype), device)


# The stdlib array typecode holding each dtype's values exactly (bool as bytes 0/1).
_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d",
              torch.bool: "B"}


def host_tensor(values: Iterable[int] | Iterable[float] | Sequence[Sequence[int]],
                dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor of `values`: a flat list goes through the stdlib array, several times
    faster than `torch.tensor(list)` (which converts element by element); nested lists and
    other dtypes go through `torch.tensor`. The same values either way."""
    code = _TYPECODES.get(dtype)
    if code is None or _nested(values):
        return torch.tensor(values, dtype=dtype)
    packed: array[Any] = array(code, values)
    if not packed:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(packed, dtype=dtype)


_NUMBERS = (int, float, bool)


def _nested(values: object) -> bool:
    """Whether `values` is a sequence of sequences. A list or tuple of numbers, a step's
    usual columns, is told without `Sequence`'s ABC check (Python-level, twice a call)."""
    if type(values) is list or type(values) is tuple:
        return bool(values) and type(values[0]) not in _NUMBERS and isinstance(values[0],
                                                                                Sequence)
    return isinstance(values, Sequence) and bool(values) and isinstance(values[0], Sequence)


class HostCopy:
    """Device tensors on their way to host memory.

    Construction queues the copies (pinned destination, `non_blocking=True`) and records
    one event after them on the current stream; `wait()` blocks until they landed and
    returns the host tensors, in the order given. CPU tensors are returned as they are.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        on_cuda = [t.device.type == "cuda" for t in tensors]
        if not any(on_cuda):
            self._host = list(tensors)
            return
        self._host = []
        for t, cuda in zip(tensors, on_cuda, strict=True):
            if not cuda:
                self._host.append(t)
                continue
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            dst.copy_(t, non_blocking=True)
            self._host.append(dst)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once every copy has finished (the only wait on the GPU)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
