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


def balance_layers(num_layers: int, budgets: Sequence[int], layer_bytes: int,
                   first_extra: int, last_extra: int, kv_bytes_per_token_layer: int
                   ) -> list[int]:
    """Layers per stage that give the pipeline the most KV room (`--layers auto`).

    Stage i has `budgets[i]` bytes (its share of its device's free memory); it holds its
    layers' weights (`layer_bytes` each), the embedding on the first stage (`first_extra`)
    and the head on the last (`last_extra`), and KV for every token of every layer it holds
    (`kv_bytes_per_token_layer`). The router sizes its pool by the stage that holds the
    fewest tokens, so the split maximises min_i (budget_i - weights_i) / (kv per token of
    stage i): a device with twice the memory takes about twice the layers, and the stages
    that carry the embedding or the head take fewer. Ties go to the stages in order.

    Raises:
        ValueError: no split fits (a stage cannot hold even one layer and its extras).
    """
    stages = len(budgets)
    if stages < 1 or stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    extras = [(first_extra if i == 0 else 0) + (last_extra if i == stages - 1 else 0)
              for i in range(stages)]

    def room_after(i: int) -> float:
        """KV tokens per layer stage i has room for once it holds one more layer."""
        used = extras[i] + (counts[i] + 1) * layer_bytes
        return (budgets[i] - used) / ((counts[i] + 1) * kv_bytes_per_token_layer)

    # Each stage's room falls as it takes layers, so handing each layer in turn to the stage
    # whose room stays largest maximises the smallest room (an exchange argument).
    counts = [1] * stages
    for _ in range(num_layers - stages):
        counts[max(range(stages), key=room_after)] += 1
    if min(budgets[i] - extras[i] - counts[i] * layer_bytes for i in range(stages)) < 0:
        raise ValueError(f"the stages' memory ({', '.join(map(str, budgets))} bytes) cannot "
                         f"hold {num_layers} layers of {layer_bytes} bytes with at least one "
                         "per stage")
    return counts
