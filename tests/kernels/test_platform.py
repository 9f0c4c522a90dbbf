"""The one platform check: devices and the TP backend, for machines with and without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.platform import (
    DeviceUnavailableError,
    Platform,
    distributed_backend,
    resolve_device,
)

CPU_ONLY = Platform(has_cuda=False, cuda_device_count=0, has_triton=False, use_triton=False)
TWO_GPUS = Platform(has_cuda=True, cuda_device_count=2, has_triton=True, use_triton=True)


@pytest.mark.parametrize(("platform", "name", "want"), [
    (CPU_ONLY, "auto", "cpu"),
    (CPU_ONLY, "cpu", "cpu"),
    (TWO_GPUS, "auto", "cuda"),
    (TWO_GPUS, "cpu", "cpu"),
    (TWO_GPUS, "cuda", "cuda"),
    (TWO_GPUS, "cuda:1", "cuda:1"),
])
def test_resolve_device(platform: Platform, name: str, want: str) -> None:
    assert resolve_device(name, platform) == torch.device(want)


@pytest.mark.parametrize(("platform", "name", "message"), [
    (CPU_ONLY, "cuda", r"'cuda': no CUDA device is visible \(use cpu\)"),
    (CPU_ONLY, "cuda:0", r"'cuda:0': no CUDA device is visible"),
    (TWO_GPUS, "cuda:2", r"'cuda:2': only 2 CUDA device\(s\) are visible"),
    (TWO_GPUS, "tpu", r"'tpu' is not a device here \(use one of auto, cpu, cuda, cuda:N\)"),
    (TWO_GPUS, "meta", r"'meta' is not a device here"),
    (CPU_ONLY, "cpu:3", r"'cpu:3' is not a device here"),
])
def test_missing_devices_are_refused_in_one_line(platform: Platform, name: str,
                                                 message: str) -> None:
    with pytest.raises(DeviceUnavailableError, match=message):
        resolve_device(name, platform)


def test_backend_follows_the_device() -> None:
    assert distributed_backend(torch.device("cpu")) == "gloo"
    assert distributed_backend(torch.device("cuda", 1)) == "nccl"


def test_imports_without_gpu_or_triton() -> None:
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch; torch.cuda.is_available = lambda: False\n"
            "from kernels.platform import PLATFORM\n"
            "assert not PLATFORM.has_cuda and not PLATFORM.use_triton\n"
            "assert PLATFORM.cuda_device_count == 0 and str(PLATFORM.default_device) == 'cpu'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
