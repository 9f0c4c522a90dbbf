"""The context a router serves: the model's, capped by --max-model-len and the KV pool."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from tests.default_model import default_model_dir
from tests.router.inprocess import in_process_mesh, stage_configs


def test_a_max_model_len_past_the_models_context_is_capped_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """The model's max_position_embeddings (8192) bounds the context, whatever
    --max-model-len asks; asking for more says so."""
    model_dir: Path = default_model_dir()

    async def run() -> int:
        stages = stage_configs(model_dir, 2, model_impl="null", num_blocks=1024)
        async with in_process_mesh(stages, max_model_len=100_000) as mesh, \
                mesh.client() as client:
            return (await client.model_info()).context_length

    with caplog.at_level(logging.WARNING, logger="stagemesh.router"):
        assert asyncio.run(run()) == 8192
    assert ("--max-model-len 100000 exceeds the model's context of 8192 tokens (its "
            "max_position_embeddings): capped at 8192") in caplog.text
