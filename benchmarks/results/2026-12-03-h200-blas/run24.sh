#!/bin/bash
# run 24: cuBLASLt for 17-128-row matmuls (after, the working tree) against cuBLAS (before), alternating
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/before && tar xzf .whl/before.tgz -C /tmp/before
export PYTHONUNBUFFERED=1
T0=$SECONDS
run() { local name=$1 dir=$2
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 70 python3 -m benchmarks.runtime_vs_hf --ours-only --batches 16,32,64,128,256 --prefill "" --out $OUT/run24_$name.json 2>&1 | grep -v Warning | tail -1)
  echo "$name done at $((SECONDS-T0)) s"; }
for r in 1 2 3; do
  run after$r $PWD
  run before$r /tmp/before
  [ $((SECONDS-T0)) -gt 300 ] && break
done
PYTHONPATH=/tmp/site:$PWD timeout 180 python3 -m pytest -m gpu -q -x tests/kernels/test_linear.py tests/stage_worker/test_gpu_runtime.py 2>&1 | tail -3
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.environ["OUT"] + "/run24_*.json")):
    d = json.load(open(p))
    print(os.path.basename(p), " ".join(f"b{x['batch']}:{x['ours_ms']:.3f}" for x in d["results"]))
PY
