"""The one platform check: which kernel implementations this process uses.

Decided once, at import, from what the machine has. Everything else asks `PLATFORM`.
Importing this module works on a machine with no GPU and no triton.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    """What the process runs on. `use_triton` picks Triton kernels over torch references."""

    has_cuda: bool
    has_triton: bool
    use_triton: bool

    @property
    def default_device(self) -> torch.device:
        return torch.device("cuda" if self.has_cuda else "cpu")


def _detect() -> Platform:
    has_cuda = torch.cuda.is_available()
    has_triton = importlib.util.find_spec("triton") is not None
    # STAGEMESH_KERNELS=torch forces the references (debugging, A/B measurements).
    forced_torch = os.environ.get("STAGEMESH_KERNELS", "").lower() == "torch"
    return Platform(has_cuda, has_triton, has_cuda and has_triton and not forced_torch)


PLATFORM = _detect()
