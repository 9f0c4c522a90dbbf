#!/usr/bin/env bash
# The test command: sets up .venv, fetches and imports the default model, runs lint, types,
# the layers contract (import-linter, [tool.importlinter] in pyproject.toml), buf lint and
# buf breaking on the protos (scripts/buf.sh) and the CPU test suite. GPU tests (marker `gpu`) are skipped without a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev,gguf
.venv/bin/stagemesh fetch-model
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
scripts/buf.sh
# pytest exits 5 when it collected nothing: that is a failure here too.
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit "$rc"
