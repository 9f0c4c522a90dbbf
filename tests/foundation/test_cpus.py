"""The cores a process may use: its affinity mask, bounded by the CPU quota of its cgroup
v2 or any cgroup above it (a container's CPU limit)."""

from __future__ import annotations

import os
from pathlib import Path

from foundation.cpus import cgroup_cpu_quota, usable_cores


def _tree(tmp_path: Path, limits: dict[str, str], line: str = "0::/kubepods/pod1/ctr\n"
          ) -> tuple[Path, Path]:
    """A cgroup root with `cpu.max` files at the given paths, and a /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    (root / "kubepods/pod1/ctr").mkdir(parents=True)
    for where, text in limits.items():
        (root / where / "cpu.max").write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(line)
    return root, proc


def test_the_smallest_quota_on_the_way_up_rounded_up(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, {"kubepods/pod1": "250000 100000\n",
                                  "kubepods/pod1/ctr": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) == 3  # 2.5 cores: a third core is partly usable
    root, proc = _tree(tmp_path / "b", {"kubepods": "400000 100000",
                                        "kubepods/pod1/ctr": "50000 100000"})
    assert cgroup_cpu_quota(root, proc) == 1


def test_no_quota_where_none_is_set_or_readable(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, {"kubepods/pod1/ctr": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) is None
    root, proc = _tree(tmp_path / "v1", {"kubepods/pod1": "100000 100000"},
                       line="4:memory:/kubepods\n1:cpu:/kubepods\n")  # cgroup v1 only
    assert cgroup_cpu_quota(root, proc) is None
    root, proc = _tree(tmp_path / "bad", {"kubepods/pod1/ctr": "garbage\n"})
    assert cgroup_cpu_quota(root, proc) is None
    assert cgroup_cpu_quota(tmp_path / "none", tmp_path / "no_such_file") is None


def test_usable_cores_is_the_mask_bounded_by_the_quota(tmp_path: Path) -> None:
    mask = len(os.sched_getaffinity(0))
    root, proc = _tree(tmp_path, {"kubepods/pod1": "100000 100000"})
    assert usable_cores(root, proc) == 1
    root, proc = _tree(tmp_path / "big", {"kubepods/pod1": f"{(mask + 8) * 100000} 100000"})
    assert usable_cores(root, proc) == mask
    assert usable_cores(tmp_path / "none", tmp_path / "no_such_file") == mask
