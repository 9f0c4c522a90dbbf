#!/bin/bash
# run 17: PDL for the Triton kernels: decode steps with PDL off / on (weight prefetch) / on (wait first), alternating; GPU kernel and runtime tests with PDL on
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$SECONDS
python3 -c "import triton, torch; from triton.language.extra.cuda import gdc_wait; print('triton', triton.__version__, 'torch', torch.__version__, torch.version.cuda)"
B="--ours-only --batches 1,16,64,256 --prefill 8x512"
run() { # name env...
  local name=$1; shift
  env "$@" timeout 70 python3 -m benchmarks.runtime_vs_hf $B --out $OUT/run17_runtime_$name.json 2>&1 | grep -v Warning | tail -4
  echo "$name done at $((SECONDS-T0)) s"
}
run off STAGEMESH_PDL=0
run on STAGEMESH_PDL=1
run onwait STAGEMESH_PDL=1 STAGEMESH_PDL_PREFETCH=0
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels tests/stage_worker/test_gpu_runtime.py > $OUT/run17_gpu_tests.log 2>&1; grep -E "passed|failed|^E  " $OUT/run17_gpu_tests.log | head -8
echo "tests done at $((SECONDS-T0)) s"
run off2 STAGEMESH_PDL=0
run on2 STAGEMESH_PDL=1
python3 - <<'PY'
import json, os, glob
out = os.environ["OUT"]
for name in ["off", "on", "onwait", "off2", "on2"]:
    p = f"{out}/run17_runtime_{name}.json"
    if not os.path.exists(p):
        print(name, "missing"); continue
    d = json.load(open(p))
    print(name, " ".join(f"{r.get('batch', r.get('prefill'))}:{r['ours_ms']:.3f}" for r in d["results"]))
PY
