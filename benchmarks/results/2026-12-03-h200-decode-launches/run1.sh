#!/bin/bash
# run 1: split-KV merge inside the attention kernel (after, the working tree) against main (before)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/before && tar xzf .whl/before.tgz -C /tmp/before
export PYTHONUNBUFFERED=1
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels/test_paged_attention_triton.py tests/stage_worker/test_gpu_runtime.py tests/stage_worker/test_mixed_graphs.py 2>&1 | tail -4
echo "tests done at $((SECONDS-T0)) s"
run() { local name=$1 dir=$2
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 80 python3 -m benchmarks.runtime_vs_hf --ours-only --batches 1,4,16,64 --prefill "" --out $OUT/run1_$name.json 2>&1 | grep -v Warning | tail -1)
  echo "$name done at $((SECONDS-T0)) s"; }
for r in 1 2 3; do
  run after$r $PWD
  run before$r /tmp/before
  [ $((SECONDS-T0)) -gt 480 ] && break
done
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.environ["OUT"] + "/run1_*.json")):
    d = json.load(open(p))
    print(os.path.basename(p), " ".join(f"b{x['batch']}: {x['ours_ms']:.3f}/{x['ours_pipelined_ms']:.3f}" for x in d["results"]))
PY
