#!/bin/bash
# run 25: decode steps alone (from an idle GPU) and pipelined (10 queued back to back)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
for r in 1 2; do
  timeout 80 python3 -m benchmarks.runtime_vs_hf --ours-only --batches 1,16,64,128,256 --prefill "" --out $OUT/run25_$r.json 2>&1 | grep -v Warning | tail -6
  echo "round $r done at $((SECONDS-T0)) s"
done
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.environ["OUT"] + "/run25_*.json")):
    d = json.load(open(p))
    for x in d["results"]:
        print(os.path.basename(p), f"b{x['batch']}: alone {x['ours_ms']:.3f} pipelined {x['ours_pipelined_ms']:.3f} host {x['ours_host_ms']:.3f}")
PY
