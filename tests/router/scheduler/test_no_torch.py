"""kvcache and the scheduler import no torch (nor numpy) and build from a tiny config."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import importlib.abc
    import sys

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "numpy"):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocker())
    from kvcache import KVCacheConfig
    from router.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2,
                                          max_model_len=16), KVCacheConfig(4, 4))
    scheduler.add_request(1, [1, 2, 3], None)
    plan = scheduler.schedule()
    assert plan is not None and plan.new_seqs[0].block_ids == (0,)
    scheduler.update(plan.step_id, {1: 4})
    scheduler.check_integrity()
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
    assert not loaded, loaded
    print("ok")
""")


def test_kvcache_and_scheduler_work_with_torch_blocked() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_blocker_really_blocks() -> None:
    script = SCRIPT.replace("from kvcache import KVCacheConfig", "import torch")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode != 0 and "blocked in this test" in done.stderr
