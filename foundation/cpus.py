"""How many cores this process may use: its affinity mask, bounded by its cgroup's CPU quota.

A container given a CPU limit (Kubernetes `resources.limits.cpu`) still sees every core of
its node in its affinity mask; the limit is a cgroup v2 quota (`cpu.max`: QUOTA PERIOD, or
`max` for none) on its cgroup or one above it. A decision that assumes a free core per
thread (the front's validation pool, the mesh's CPU policy) reads this instead of the mask.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
                 ) -> int:
    """The cores in this process's affinity mask (all the machine's where there is none),
    at most its cgroup's CPU quota rounded up; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return max(1, cores if quota is None else min(cores, quota))


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT,
                     proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The smallest CPU quota, in whole cores rounded up, of this process's cgroup v2 and
    the cgroups above it; None where none is set or cgroup v2 is not mounted there."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:  # cgroup v1 only
        return None
    here = cgroup_root / path.lstrip("/")
    limits = []
    for directory in (here, *here.parents):
        if not directory.is_relative_to(cgroup_root):
            break
        limit = _cpu_max(directory / "cpu.max")
        if limit is not None:
            limits.append(limit)
    return min(limits, default=None)


def _cpu_max(path: Path) -> int | None:
    """ceil(QUOTA / PERIOD) of a `cpu.max` file; None for `max`, no file or a bad one."""
    try:
        quota, period = path.read_text().split()[:2]
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # "max", no such file, or not two numbers
        return None
