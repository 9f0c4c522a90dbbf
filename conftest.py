"""Repository-wide pytest set-up: GPU tests are skipped where there is no CUDA device."""

from __future__ import annotations

import pytest

from kernels.platform import PLATFORM


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PLATFORM.has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
