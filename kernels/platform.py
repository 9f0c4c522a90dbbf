"""The one platform check: what this process runs on and which kernels it uses.

Decided once, at import, from what the machine has. Everything else asks this module:
kernels (`PLATFORM.use_triton`), the devices a command or stage picks (`resolve_device`,
`PLATFORM.cuda_device_count`) and the TP group's backend (`distributed_backend`).
Importing this module works on a machine with no GPU and no triton.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")

# Triton kernels run in Triton's interpreter (the CPU tests): numpy has no 16-bit matmul and
# no device properties, so kernels pick interpreter-safe variants.
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class DeviceUnavailableError(ValueError):
    """A device was asked for that this machine does not have, or a name that is no device.
    The message says what was asked and what there is."""


@dataclass(frozen=True)
class Platform:
    """What the process runs on. `use_triton` picks Triton kernels over torch references."""

    has_cuda: bool
    cuda_device_count: int
    has_triton: bool
    use_triton: bool

    @property
    def default_device(self) -> torch.device:
        """cuda where there is a CUDA device, else cpu (what "auto" means)."""
        return torch.device("cuda" if self.has_cuda else "cpu")


def _detect() -> Platform:
    has_cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if has_cuda else 0
    has_triton = importlib.util.find_spec("triton") is not None
    # STAGEMESH_KERNELS=torch forces the references (debugging, A/B measurements).
    forced_torch = os.environ.get("STAGEMESH_KERNELS", "").lower() == "torch"
    return Platform(has_cuda, count, has_triton, has_cuda and has_triton and not forced_torch)


PLATFORM = _detect()


def resolve_device(name: str, platform: Platform = PLATFORM) -> torch.device:
    """The device a "--device" value means here.

    Args:
        name: "auto" (cuda when there is one, else cpu), "cpu", "cuda" or "cuda:N".
        platform: what the machine has (tests pass their own).
    Raises:
        DeviceUnavailableError: CUDA asked for and absent, an index past the devices there
            are, or a name that is none of the above.
    """
    if name == "auto":
        return platform.default_device
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")  # refused below, with the same message
    if device.type == "cpu" and device.index is None:
        return device
    if device.type != "cuda":
        raise DeviceUnavailableError(
            f"{name!r} is not a device here (use one of {', '.join(DEVICE_CHOICES)})")
    if not platform.has_cuda:
        raise DeviceUnavailableError(f"{name!r}: no CUDA device is visible (use cpu)")
    if device.index is not None and device.index >= platform.cuda_device_count:
        raise DeviceUnavailableError(
            f"{name!r}: only {platform.cuda_device_count} CUDA device(s) are visible")
    return device


def distributed_backend(device: torch.device) -> str:
    """The torch.distributed backend of a TP group computing on `device`: NCCL for CUDA
    tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"
