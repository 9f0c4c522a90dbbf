#!/bin/bash
# runtime_vs_hf at HEAD (decode 1/64/256 with the kernel floor, prefill), two rounds; then the
# kernel and runtime GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site <wheels>/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
cp -r <generated protos>/. protos/
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
T0=$SECONDS
for r in 1 2; do
  timeout 200 python3 -m benchmarks.runtime_vs_hf --ours-only --batches 1,64,256 --prefill 8x512,1x4096 --out $OUT/rt_r$r.json > $OUT/rt_r$r.txt 2>&1
  echo "round $r done at $((SECONDS-T0)) s (rc $?)"; tail -3 $OUT/rt_r$r.txt
done
timeout $((570-SECONDS+T0)) python3 -m pytest -q -p no:cacheprovider -m gpu --timeout 200 tests/kernels tests/stage_worker/test_gpu_runtime.py tests/stage_worker/test_warm_up.py > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
python3 - <<'PY'
import json, os
for r in (1, 2):
    p = f"{os.environ['OUT']}/rt_r{r}.json"
    if not os.path.exists(p): continue
    d = json.load(open(p))
    print("roof", {k: round(v, 2) for k, v in d["config"]["roofline"].items()}, d.get("revision"))
    for x in d["results"]:
        if "batch" in x:
            print(f"b{x['batch']}: alone {x['ours_ms']:.3f} pipelined {x['ours_pipelined_ms']:.3f} bytes-roof {x['roofline_ms']:.3f} kernel-floor {x['kernel_floor_ms']:.3f} ratio {x['kernel_floor_ms']/x['ours_pipelined_ms']:.3f}")
        else:
            print(f"prefill {x['prefill']}: {x['ours_ms']:.1f} ms {x['ours_tok_s']:.0f} tok/s {x['of_matmul_rate']:.3f} of matmul")
PY
cd $OUT && tar czf run15.tgz *.txt *.json && rm -f *.txt *.json
