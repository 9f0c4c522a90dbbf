"""What the fp8 linear layers' references (`kernels.fp8_linear`) and Triton kernels
(`kernels.fp8_linear_triton`) share: the stored format and the skinny kernel's row limit."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
SKINNY_ROWS = 64  # the most rows the weight-streaming kernel takes (a 64-row tile)
