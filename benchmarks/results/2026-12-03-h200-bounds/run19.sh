#!/bin/bash
# run 19 (upper bounds, a throwaway patch): decode steps with the norm kernels or the rope + KV write kernel skipped at <= 16 rows (wrong values; timing only)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
run() { local name=$1; shift
  env "$@" timeout 60 python3 -m benchmarks.runtime_vs_hf --ours-only --batches 1,16 --prefill "" --out $OUT/run19_$name.json 2>&1 | grep -v Warning | tail -2
  echo "$name done at $((SECONDS-T0)) s"; }
for r in 1 2; do
  run base$r XB=0
  run nonorm$r XB_NONORM=1
  run norope$r XB_NOROPE=1
  run neither$r XB_NONORM=1 XB_NOROPE=1
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for r in (1, 2):
    for name in ("base", "nonorm", "norope", "neither"):
        p = f"{out}/run19_{name}{r}.json"
        if os.path.exists(p):
            d = json.load(open(p))
            print(name, r, " ".join(f"b{x['batch']}:{x['ours_ms']:.3f}" for x in d["results"]))
PY
