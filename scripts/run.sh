#!/usr/bin/env bash
# The run command: sets up .venv, fetches and imports the default model, then answers one
# request on it.  Usage: scripts/run.sh ["prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh gguf
.venv/bin/stagemesh fetch-model
exec .venv/bin/stagemesh generate --chat "${1:-What is the capital of France?}"
