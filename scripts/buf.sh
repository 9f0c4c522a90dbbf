#!/usr/bin/env bash
# The protos' checks: `buf lint` (protos/buf.yaml) and `buf breaking` against the public
# API's last release (the revision in protos/RELEASED), so a change that would break an
# existing client fails the test command. buf comes from the npm registry (@bufbuild/buf),
# installed once under .venv/buf.
set -euo pipefail
cd "$(dirname "$0")/.."
BUF_VERSION=1.75.0
buf=.venv/buf/node_modules/.bin/buf
if [ ! -x "$buf" ] || [ "$("$buf" --version)" != "$BUF_VERSION" ]; then
  if ! command -v npm >/dev/null; then
    echo "scripts/buf.sh: buf installs with npm (Node.js); install Node.js and rerun" >&2
    exit 1
  fi
  npm install --silent --no-audit --no-fund --prefix .venv/buf "@bufbuild/buf@$BUF_VERSION"
fi
released=$(tr -d '[:space:]' < protos/RELEASED)
if ! git cat-file -e "$released^{commit}" 2>/dev/null; then
  echo "scripts/buf.sh: the released revision $released is not in this clone (a shallow" \
       "clone?): run 'git fetch --unshallow' first" >&2
  exit 1
fi
"$buf" lint protos
"$buf" breaking protos --against ".git#ref=$released,subdir=protos"
echo "buf: lint clean, no breaking change against $released"
