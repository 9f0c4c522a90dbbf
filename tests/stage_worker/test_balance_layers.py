"""`--layers auto`'s split (`balance_layers`): the pipeline's KV room (the fewest tokens any
stage holds) as large as any split can make it, checked against every split of small
pipelines; more memory takes more layers, the embedding and the head fewer."""

from __future__ import annotations

import itertools
import random

import pytest

from stage_worker.partition import balance_layers, partition_layers


def room(counts: list[int], budgets: list[int], layer: int, first: int, last: int,
         kv: int) -> float:
    """Tokens of KV the pipeline holds with this split: its smallest stage's."""
    n = len(counts)
    return min((b - c * layer - (first if i == 0 else 0) - (last if i == n - 1 else 0))
               / (c * kv) for i, (b, c) in enumerate(zip(budgets, counts, strict=True)))


def test_the_split_is_as_good_as_the_best_of_all_splits() -> None:
    rng = random.Random(0)
    for _ in range(200):
        stages, layers = rng.randint(1, 3), rng.randint(3, 12)
        layers = max(layers, stages)
        budgets = [rng.randint(50, 400) for _ in range(stages)]
        layer, first, last, kv = rng.randint(1, 10), rng.randint(0, 40), rng.randint(0, 40), 1
        try:
            got = balance_layers(layers, budgets, layer, first, last, kv)
        except ValueError:
            continue
        assert sum(got) == layers and min(got) >= 1
        splits = [list(c) for c in itertools.product(range(1, layers + 1), repeat=stages)
                  if sum(c) == layers]
        best = max(room(c, budgets, layer, first, last, kv) for c in splits)
        assert room(got, budgets, layer, first, last, kv) == pytest.approx(best), (
            budgets, layer, first, last, got)


def test_more_memory_takes_more_layers_and_equal_devices_split_evenly() -> None:
    gb = 1 << 30
    layer, embed, kv = 436 << 20, 128256 * 4096 * 2, 2 * 8 * 128 * 2  # llama3-8b, bf16
    assert balance_layers(32, [70 * gb, 70 * gb], layer, embed, embed, kv) == [16, 16]
    assert balance_layers(32, [120 * gb, 40 * gb], layer, embed, embed, kv) == [24, 8]
    even = [len(r) for r in partition_layers(32, 4)]
    assert balance_layers(32, [40 * gb] * 4, layer, embed, embed, kv) == even
    # a heavy embedding and head push layers to the middle stage
    first, middle, last = balance_layers(30, [10 * gb] * 3, 100 << 20, 3 * gb, 3 * gb, 1 << 10)
    assert middle > first == last


def test_memory_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold 8 layers"):
        balance_layers(8, [100, 100], 30, 0, 0, 1)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balance_layers(2, [100, 100, 100], 1, 0, 0, 1)
