"""Put on a stage process's PYTHONPATH as sitecustomize.py: STAGE_PROF_T0 seconds after the
stage starts, a CUDA-only torch.profiler trace of STAGE_PROF_S seconds goes to
$OUT/stage_trace.json (summarized by trace_summary.py)."""

import os
import sys
import threading
import time

if "--stage-index" in sys.argv and os.environ.get("STAGE_PROF_T0"):
    def _run():
        time.sleep(float(os.environ["STAGE_PROF_T0"]))
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            time.sleep(float(os.environ.get("STAGE_PROF_S", "1.0")))
        out = os.environ["OUT"]
        path = f"{out}/stage_trace.json"
        prof.export_chrome_trace(path)
    threading.Thread(target=_run, daemon=True).start()
