#!/bin/bash
# run 2: rope + KV write folded into the decode attention launch (after) against main (before)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/before /tmp/after && tar xzf .whl/before.tgz -C /tmp/before && tar xzf .whl/after.tgz -C /tmp/after
export PYTHONUNBUFFERED=1
T0=$SECONDS
(cd /tmp/after && PYTHONPATH=/tmp/site:/tmp/after timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels tests/stage_worker/test_gpu_runtime.py tests/stage_worker/test_mixed_graphs.py tests/stage_worker/test_kv_cache_dtype.py tests/stage_worker/test_model_vs_hf.py 2>&1 | tail -5)
echo "tests done at $((SECONDS-T0)) s"
run() { local name=$1 dir=$2
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 80 python3 -m benchmarks.runtime_vs_hf --ours-only --batches 1,16,64,256 --prefill "" --out $OUT/run2_$name.json 2>&1 | grep -v Warning | tail -1)
  echo "$name done at $((SECONDS-T0)) s"; }
for r in 1 2 3; do
  run after$r /tmp/after
  run before$r /tmp/before
  [ $((SECONDS-T0)) -gt 400 ] && break
done
(cd /tmp/after && PYTHONPATH=/tmp/site:/tmp/after timeout $((570-SECONDS+T0)) python3 -m benchmarks.runtime_vs_hf --batches 1,4 --out $OUT/run2_hf_after.json 2>&1 | grep -v Warning | tail -12)
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.environ["OUT"] + "/run2_[ab]*.json")):
    d = json.load(open(p))
    print(os.path.basename(p), " ".join(f"b{x['batch']}: {x['ours_ms']:.3f}/{x['ours_pipelined_ms']:.3f}" for x in d["results"]))
PY
