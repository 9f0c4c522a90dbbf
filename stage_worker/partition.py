"""Pipeline partition: which contiguous layers each stage owns. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerRange:
    """Layers [start, end) of one stage, and whether it holds the embedding / the head."""

    start: int
    end: int
    is_first: bool
    is_last: bool

    def __len__(self) -> int:
        return self.end - self.start


def partition_layers(
    num_layers: int, num_stages: int, override: Sequence[int] | None = None
) -> list[LayerRange]:
    """Split `num_layers` into `num_stages` contiguous ranges.

    Without `override`, layers are spread as evenly as possible; remainder layers go first to
    the middle stages (they hold neither the embedding nor the head), then to the first, then
    to the last. `override` gives the layer count per stage explicitly (stages with more
    memory take more layers).

    Raises:
        ValueError: impossible split (more stages than layers, override that does not sum).
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if override is not None:
        counts = list(override)
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"layer override {counts} must give {num_stages} positive counts "
                f"summing to {num_layers}"
            )
    else:
        if num_stages > num_layers:
            raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
        base, extra = divmod(num_layers, num_stages)
        counts = [base] * num_stages
        # Remainder layers go to stages that hold neither embedding nor head first.
        order = [*range(1, num_stages - 1), 0, num_stages - 1]
        for i in order[:extra]:
            counts[i] += 1
    ranges: list[LayerRange] = []
    start = 0
    for i, n in enumerate(counts):
        ranges.append(LayerRange(start, start + n, i == 0, i == num_stages - 1))
        start += n
    return ranges
