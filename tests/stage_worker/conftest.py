from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from stage_worker.dataplane import TcpTransport
from tests.stage_worker.dataplane_helpers import linked_pair
from tests.stage_worker.tiny_checkpoints import VARIANTS, write_tiny_checkpoint


@pytest.fixture(scope="session", params=sorted(VARIANTS))
def tiny_checkpoint(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """(checkpoint dir, the HF model that wrote it) for every tiny variant."""
    out = tmp_path_factory.mktemp(request.param)
    return out, write_tiny_checkpoint(request.param, out)


@pytest.fixture(params=["tcp", "unix"])
def link(request: pytest.FixtureRequest) -> Iterator[tuple[TcpTransport, TcpTransport]]:
    """(sender, receiver) of one link, over loopback TCP and over a Unix-domain socket: the
    same stream either way."""
    sender, receiver = linked_pair(kind=request.param)
    yield sender, receiver
    sender.close()
    receiver.close()
