#!/usr/bin/env bash
# Creates ./.venv (once) and installs stagemesh with the extras given as arguments.
# Idempotent: re-running only reinstalls when pyproject.toml or a .proto file changed (the
# install generates the gRPC code).
#   scripts/setup.sh dev,gguf
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-gguf}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating virtual environment .venv"
    "$PY" -m venv .venv
fi
STAMP=".venv/.stagemesh-installed-$EXTRAS"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] \
        || [ -n "$(find protos -name '*.proto' -newer "$STAMP" 2>/dev/null)" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch first and pinned: the CPU build (a newer release or an unpinned resolve pulls a
    # multi-GB CUDA build). A machine with a CUDA torch already in the venv keeps it.
    if ! .venv/bin/python -c "import torch" 2>/dev/null; then
        echo "[setup] installing torch ${STAGEMESH_TORCH:-2.13.0}"
        .venv/bin/python -m pip install -q "torch==${STAGEMESH_TORCH:-2.13.0}"
    fi
    echo "[setup] installing stagemesh[$EXTRAS] (generates the gRPC code)"
    LOG=.venv/setup.log
    if ! .venv/bin/python -m pip install -e ".[$EXTRAS]" >"$LOG" 2>&1; then
        tail -40 "$LOG" >&2
        echo "[setup] install failed; full log in $LOG" >&2
        exit 1
    fi
    touch "$STAMP"
fi
