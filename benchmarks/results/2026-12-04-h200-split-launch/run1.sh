#!/bin/bash
# run 1: SPLIT_DECODE_LAUNCH for split-KV decode attention (after, the working tree) against
# 6f1900d (before); GPU tests of the after tree first; the attention kernel's grid last.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/before && tar xzf .whl/before.tgz -C /tmp/before
export PYTHONUNBUFFERED=1
T0=$SECONDS
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels tests/stage_worker/test_gpu_runtime.py tests/stage_worker/test_warm_up.py 2>&1 | tail -4
echo "tests done at $((SECONDS-T0)) s"
run() { local name=$1 dir=$2
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 80 python3 -m benchmarks.runtime_vs_hf --ours-only --batches 1,16,64 --prefill "" --out $OUT/run1_$name.json 2>&1 | grep -v Warning | tail -1)
  echo "$name done at $((SECONDS-T0)) s"; }
for r in 1 2 3; do
  run after$r $PWD
  run before$r /tmp/before
  [ $((SECONDS-T0)) -gt 420 ] && break
done
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.environ["OUT"] + "/run1_*.json")):
    d = json.load(open(p))
    print(os.path.basename(p), " ".join(f"b{x['batch']}: {x['ours_ms']:.3f}/{x['ours_pipelined_ms']:.3f}" for x in d["results"]))
PY
PYTHONPATH=/tmp/site:$PWD timeout $((585-SECONDS+T0)) python3 -m benchmarks.attention_kernel --reps 20 --out $OUT/run1_attention_kernel.json 2>&1 | tail -11
