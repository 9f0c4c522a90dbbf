#!/bin/bash
# run 23: decode and prefill steps with torch's cuBLAS backend against cuBLASLt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
run() { local name=$1; shift
  timeout 90 python3 -m benchmarks.runtime_vs_hf --ours-only --batches 1,16,64,128,256 "$@" --out $OUT/run23_$name.json 2>&1 | grep -v Warning | grep -E "prefill|^ *[0-9]+ " | tail -8
  echo "$name done at $((SECONDS-T0)) s"; }
for r in 1 2; do
  run default$r --blas default
  run lt$r --blas cublaslt
  [ $((SECONDS-T0)) -gt 380 ] && break
done
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.environ["OUT"] + "/run23_*.json")):
    d = json.load(open(p))
    print(os.path.basename(p), " ".join(f"{x.get('batch', x.get('prefill'))}:{x['ours_ms']:.3f}" for x in d["results"]))
PY
