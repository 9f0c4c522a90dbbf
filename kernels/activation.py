"""SiLU-and-multiply of a merged gate/up projection. Torch reference (also the CPU path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2*I] laid out [gate | up]; returns silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
