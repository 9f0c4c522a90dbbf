#!/usr/bin/env bash
# The multi-GPU run, on a machine with 2 (or 4) GPUs: each part writes its JSON under OUT and
# prints its table; a part that fails is reported and the next one runs.
#
#   benchmarks/multi_gpu.sh OUT [PART ...]
#
# Parts (default: every part the machine's GPU count allows, in this order):
#   tp      one stage at TP 1 and TP 2 (NCCL all-reduce, CUDA graphs): greedy tokens and
#           logprobs of 8 seeded prompts against TP 1's, decode step at batch 1 and 64
#           against TP 1's and two cards' roofline                               (2 GPUs)
#   hop     per-hop latency cuda:0 -> cuda:1 over tcp, cuda_ipc and nccl        (2 GPUs)
#   w1      W1 at 1 stage and at 2 stages on 2 GPUs, hops over nccl and over cuda_ipc
#                                                                                (2 GPUs)
#   kill    stage 1 SIGKILLed mid-stream, 2 stages on 2 GPUs, nccl hops: no stream lost,
#           the hop rebuilt                                                      (2 GPUs)
#   tp2x2   2 stages x TP 2: W1, W2 (3 runs), W5 at 8 req/s, and the kill       (4 GPUs)
#
# Environment: MODEL, a llama3-8b-shaped checkpoint (default: one with random weights is
# written to /tmp/l8b, with the tokenizer of TOKENIZER, default the default model's).
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off on shared multi-GPU hosts (a program that uses it can take the
# host's GPUs out of service); every process of the mesh inherits these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${1:?usage: benchmarks/multi_gpu.sh OUT [PART ...]}
shift
mkdir -p "$OUT"
PY=${PYTHON:-python3}
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$#" -gt 0 ]; then
  PARTS="$*"
elif [ "$GPUS" -ge 4 ]; then
  PARTS="tp hop w1 kill tp2x2"
elif [ "$GPUS" -ge 2 ]; then
  PARTS="tp hop w1 kill"
else
  echo "multi_gpu.sh: $GPUS GPU(s) here; every part needs 2 or more" >&2
  exit 1
fi
echo "multi_gpu.sh: $GPUS GPU(s); parts: $PARTS; revision $(git rev-parse --short HEAD 2>/dev/null)"

MODEL=${MODEL:-/tmp/l8b}
if [ ! -f "$MODEL/config.json" ]; then
  TOKENIZER=${TOKENIZER:-$($PY -c "from foundation.modelstore import resolve_model; print(resolve_model('default'))")}
  echo "writing a random llama3-8b checkpoint to $MODEL (tokenizer: $TOKENIZER)"
  $PY -m benchmarks.make_random_model --shape llama3-8b --tokenizer "$TOKENIZER" --out "$MODEL" || exit 1
fi
W1=(--model "$MODEL" --device cuda --requests 256 --prompt-len 512 --output-len 256)
failed=()

run() {  # run NAME CMD...: the command's output to OUT/NAME.log and the terminal
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$name")
}

for part in $PARTS; do
  case $part in
    tp)
      run tp $PY -m benchmarks.tp_compare --model "$MODEL" --device cuda --tp 1,2 \
        --batches 1,64 --out "$OUT/tp.json" ;;
    hop)
      run hop $PY -m benchmarks.hop_latency --device cuda:0 --peer-device cuda:1 \
        --transports tcp,cuda_ipc,nccl --out "$OUT/hop.json" ;;
    w1)
      run w1_1stage $PY -m benchmarks.throughput "${W1[@]}" --stages 1 --out "$OUT/w1_1stage.json"
      for transport in nccl cuda_ipc; do
        run "w1_2stages_$transport" $PY -m benchmarks.throughput "${W1[@]}" --stages 2 \
          --extra "--transport $transport" --out "$OUT/w1_2stages_$transport.json"
      done ;;
    kill)
      run kill $PY -m benchmarks.failover --how restart --rounds 1 --model "$MODEL" \
        --device cuda --transport nccl --out "$OUT/kill.json" ;;
    tp2x2)
      run w1_2x2 $PY -m benchmarks.throughput "${W1[@]}" --stages 2 --extra "--tp 2 --transport nccl" \
        --out "$OUT/w1_2x2.json"
      run w2_2x2 $PY -m benchmarks.throughput --model "$MODEL" --device cuda --stages 2 \
        --requests 1 --prompt-len 128 --output-len 256 --repeat 3 \
        --extra "--tp 2 --transport nccl" --out "$OUT/w2_2x2.json"
      run w5_2x2 $PY -m benchmarks.serving --model "$MODEL" --device cuda --stages 2 --tp 2 \
        --extra "--transport nccl" --rates 8 --out "$OUT/w5_2x2.json"
      run kill_2x2 $PY -m benchmarks.failover --how restart --rounds 1 --model "$MODEL" \
        --device cuda --tp 2 --transport nccl --out "$OUT/kill_2x2.json" ;;
    *)
      echo "multi_gpu.sh: unknown part '$part' (tp, hop, w1, kill, tp2x2)" >&2
      failed+=("$part") ;;
  esac
done

if [ "${#failed[@]}" -gt 0 ]; then
  echo "multi_gpu.sh: failed: ${failed[*]} (their logs are under $OUT)" >&2
  exit 1
fi
echo "multi_gpu.sh: every part ran; results under $OUT"
