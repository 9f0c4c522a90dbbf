#!/usr/bin/env bash
# The run command: sets up .venv, fetches and imports the default model, brings up the whole
# mesh (2 stages, router, HTTP gateway) on this machine, answers one request, then keeps
# serving until Ctrl-C. STAGEMESH_ONCE=1 stops it after the answer.
#   scripts/run.sh ["your question"]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh gguf
.venv/bin/stagemesh fetch-model
.venv/bin/stagemesh serve --stages "${STAGEMESH_STAGES:-2}" --tp "${STAGEMESH_TP:-1}" &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 1200); do  # up to 10 minutes for a first start
    if .venv/bin/python - <<'PY' 2>/dev/null; then break; fi
import grpc
from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g
with grpc.insecure_channel("127.0.0.1:50051") as ch:
    r = g.HealthStub(ch).Check(h.HealthCheckRequest(service="readiness"), timeout=1)
    raise SystemExit(0 if r.status == h.HealthCheckResponse.SERVING else 1)
PY
    kill -0 $SERVE 2>/dev/null || { echo "stagemesh serve exited" >&2; exit 1; }
    sleep 0.5
done
QUESTION="${1:-What is the capital of France?}"
echo "--- gRPC (stagemesh ask):" >&2
.venv/bin/stagemesh ask "$QUESTION"
echo "--- HTTP (OpenAI chat completions through the gateway):" >&2
.venv/bin/python - "$QUESTION" <<'PY'
import json, sys, urllib.request
body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 128, "temperature": 0,
        "messages": [{"role": "user", "content": sys.argv[1]}]}
req = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions",
                             json.dumps(body).encode(), {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"])
PY
if [ "${STAGEMESH_ONCE:-0}" = "1" ]; then exit 0; fi
echo "serving: gRPC 127.0.0.1:50051, HTTP http://127.0.0.1:8000/v1 (Ctrl-C stops)" >&2
wait $SERVE
