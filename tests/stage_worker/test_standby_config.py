"""The config a standby stage takes when assigned a place: exactly the layer range asked
for, whatever the other stages' split, and the pipeline's capacity."""

from __future__ import annotations

from pathlib import Path

import pytest

from stage_worker.config import StageConfig
from stage_worker.partition import partition_layers
from stage_worker.standby import assigned_config

BASE = StageConfig(Path("/nonexistent"), standby=True)


@pytest.mark.parametrize(("index", "stages", "start", "end"), [
    (0, 1, 0, 30), (0, 2, 0, 15), (1, 2, 15, 30), (1, 3, 10, 20), (1, 3, 1, 29),
    (2, 4, 5, 6), (3, 4, 29, 30), (0, 3, 0, 28),
])
def test_the_assigned_range_is_exactly_the_one_asked(index: int, stages: int, start: int,
                                                      end: int) -> None:
    cfg = assigned_config(BASE, 30, index, stages, start, end, 512, 256, 32)
    layers = partition_layers(30, cfg.num_stages, cfg.layer_override)[cfg.stage_index]
    assert (layers.start, layers.end) == (start, end)
    assert (cfg.num_blocks, cfg.max_num_batched_tokens, cfg.max_num_seqs) == (512, 256, 32)
    assert cfg.standby  # the process stays a standby process; its servicer delegates


@pytest.mark.parametrize(("index", "stages", "start", "end"), [
    (1, 2, 0, 30),  # stage 1 cannot start at layer 0
    (0, 2, 1, 15),  # stage 0 starts at layer 0
    (1, 2, 15, 29),  # the last stage ends at the last layer
    (2, 3, 1, 30),  # two stages cannot fit in one layer before it
    (0, 1, 0, 31),  # past the model
    (2, 2, 15, 30),  # no such stage
])
def test_impossible_places_are_refused(index: int, stages: int, start: int, end: int) -> None:
    with pytest.raises(ValueError, match="cannot hold layers"):
        assigned_config(BASE, 30, index, stages, start, end, 512, 256, 32)
