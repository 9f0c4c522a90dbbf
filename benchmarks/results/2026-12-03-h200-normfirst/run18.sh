#!/bin/bash
# run 18: the RMSNorm inside the weight-streaming kernel (working tree) against 1e957c7: GPU tests, decode steps alternating
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
mkdir -p /tmp/before && tar xzf .whl/before.tgz -C /tmp/before && cp -r protos/* /tmp/before/protos/ 2>/dev/null
T0=$SECONDS
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_linear.py tests/stage_worker/test_gpu_runtime.py tests/stage_worker/test_mixed_graphs.py > $OUT/run18_gpu_tests.log 2>&1; grep -E "passed|failed|^FAILED" $OUT/run18_gpu_tests.log | head -12
echo "tests done at $((SECONDS-T0)) s"
for tree in after before after2 before2; do
  case $tree in before*) dir=/tmp/before;; *) dir=$PWD;; esac
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 60 python3 -m benchmarks.runtime_vs_hf --ours-only --batches 1,4,16,64 --prefill "" --out $OUT/run18_runtime_$tree.json 2>&1 | grep -v Warning | tail -4)
  echo "$tree done at $((SECONDS-T0)) s"
done
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for name in ["after", "before", "after2", "before2"]:
    p = f"{out}/run18_runtime_{name}.json"
    if not os.path.exists(p):
        print(name, "missing"); continue
    d = json.load(open(p))
    print(name, " ".join(f"{r.get('batch', r.get('prefill'))}:{r['ours_ms']:.3f}" for r in d["results"]))
PY
