#!/usr/bin/env bash
# Install LocalStack (S3 only is used) into build/localstack-venv, without Docker.
#
# LocalStack's runtime needs Python >= 3.13 here, so it gets its own virtualenv made from
# pyenv's 3.13 (or any python3.13 on PATH); the test suite (Python 3.11) only starts it as a
# subprocess (objckpt.testing.s3_servers.LocalStackServer). Idempotent: a venv that already
# imports localstack is left alone. Prints how long the install took.
#
#   bash scripts/localstack.sh            # install if missing
#   FORCE=1 bash scripts/localstack.sh    # reinstall from scratch
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/build/localstack-venv"
start=$(date +%s)

find_python() {
  local candidate
  if command -v pyenv >/dev/null 2>&1; then
    # newest installed 3.13.x first
    for candidate in $(ls -d "$(pyenv root)"/versions/3.13.*/bin/python3 2>/dev/null | sort -rV); do
      [ -x "$candidate" ] && { echo "$candidate"; return 0; }
    done
  fi
  if command -v python3.13 >/dev/null 2>&1; then
    # a pyenv shim exists even when no 3.13 is installed: check it actually runs
    python3.13 -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null \
      && { command -v python3.13; return 0; }
  fi
  return 1
}

if [ "${FORCE:-0}" = 1 ]; then
  rm -rf "$VENV"
fi

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import localstack.runtime.main' 2>/dev/null; then
  echo "LocalStack already installed in $VENV ($("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("localstack-core"))'))"
  exit 0
fi

PY="$(find_python)" || {
  echo "error: LocalStack needs Python 3.13 (pyenv install 3.13 or put python3.13 on PATH)" >&2
  exit 1
}
echo "using $PY ($("$PY" -V))"
rm -rf "$VENV"
mkdir -p "$ROOT/build"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# Pins: newer cbor2 / pyOpenSSL / cryptography releases break localstack-core's runtime imports
# on this machine; service_identity silences hypercorn's TLS warning.
"$VENV/bin/python" -m pip install --quiet \
  "localstack-core[runtime]" "cbor2<6" "pyopenssl<26" "cryptography<47" service_identity
"$VENV/bin/python" -c 'import localstack.runtime.main'
version=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("localstack-core"))')
echo "installed localstack-core $version into $VENV in $(( $(date +%s) - start ))s"
