#!/bin/bash
# run 22: the weight-streaming kernel against cuBLAS at 32 and 64 rows (decode batch 64's projections)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 500 python3 -m benchmarks.skinny_gemm --rows 64,32 --out $OUT/skinny_gemm_m32_64.json 2>&1 | grep -v Warning | tail -12
