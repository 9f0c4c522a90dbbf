"""What a layer's weight loader receives: something sliceable like a tensor.

Both `torch.Tensor` and the lazy slice from `safetensors.safe_open(...).get_slice(name)`
qualify, so a loader reads only the rows/columns this rank owns from disk.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class WeightSource(Protocol):
    """A checkpoint tensor that can be sliced before it is read."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...

    def get_shape(self) -> list[int]: ...


class TensorSource:
    """Adapts an in-memory tensor to `WeightSource` (tests, tied weights)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copy `loaded` into `param` (casting dtype), refusing a shape mismatch by name."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"weight {name}: checkpoint slice has shape {tuple(loaded.shape)}, "
            f"the layer expects {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))
