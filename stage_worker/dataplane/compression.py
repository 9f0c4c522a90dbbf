"""Activation compression on a data-plane hop, chosen by the sending stage.

A stage sends its output activations [T, H] downstream in one of these forms; the receiver
reads which from the message's tensors (their dtypes are in the wire table), so only the
sender is configured and a hop can change form between steps:

- ``none``: the activations as the stage computed them, one tensor.
- ``bf16`` / ``fp16``: one tensor cast to that dtype (half the bytes of fp32; nothing saved
  when the stage already computes in 16 bits).
- ``int8``: two tensors, the values quantized per token and per group of `INT8_GROUP`
  channels, q = round(x / s) in [-127, 127] (int8 [T, H]), and the scales s = max|x| / 127
  over each token's group (float32 [T, H / G]); 27 % of fp32's bytes at G = 64. A group of
  zeros gets scale 1. One scale per whole token row (G = H) was measured first: a decoder's
  residual stream carries a few channels hundreds of times larger than the rest, and one
  scale per row rounds the rest away (the default model's greedy output diverged after ~11
  tokens); per-group scales confine an outlier to its group.

The receiver turns any of these back into its own dtype. Meant for links where bandwidth
is scarce (TCP, NCCL across hosts); each form's error against the uncompressed model is
measured by `benchmarks.activation_compression`.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch


class Compression(Enum):
    NONE = "none"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"


CHOICES = tuple(c.value for c in Compression)
_CASTS = {Compression.BF16: torch.bfloat16, Compression.FP16: torch.float16}
INT8_GROUP = 64  # channels per scale (a row whose width it does not divide: one scale)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class CompressedFormError(ValueError):
    """The tensors are not activations in any form `compress` makes (or not the shape the
    step needs)."""


def compress(x: torch.Tensor, mode: Compression) -> list[torch.Tensor]:
    """x [T, H] (any float dtype, any device) -> the tensors to send for `mode`."""
    if mode is Compression.NONE or x.dtype == _CASTS.get(mode):
        return [x]
    if mode in _CASTS:
        return [x.to(_CASTS[mode])]
    rows, width = x.shape
    group = INT8_GROUP if width % INT8_GROUP == 0 else width
    x32 = x.float().reshape(rows, width // group, group)
    scale = x32.abs().amax(dim=-1) / 127.0  # [T, H / G]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x32 / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return [q.reshape(rows, width), scale]


def decompress(tensors: Sequence[torch.Tensor], shape: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """The activations [T, H] in `dtype` from what `compress` sent, whatever its mode.

    Raises CompressedFormError naming what came and what the step needs.
    """
    if len(tensors) == 1 and tensors[0].dtype in _FLOATS and tuple(tensors[0].shape) == shape:
        return tensors[0].to(dtype)
    if (len(tensors) == 2 and tensors[0].dtype == torch.int8
            and tuple(tensors[0].shape) == shape and tensors[1].dtype == torch.float32
            and tensors[1].dim() == 2 and tensors[1].shape[0] == shape[0]
            and tensors[1].shape[1] > 0 and shape[1] % tensors[1].shape[1] == 0):
        q, scale = tensors
        rows, groups = scale.shape
        grouped = q.float().reshape(rows, groups, shape[1] // groups) * scale[..., None]
        return grouped.reshape(shape).to(dtype)
    got = [f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors]
    raise CompressedFormError(
        f"got {got}; the step needs {list(shape)} activations as one float tensor, or int8 "
        f"{list(shape)} with float32 [{shape[0]}, groups] scales (groups dividing "
        f"{shape[1]})")
