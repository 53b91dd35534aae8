#!/usr/bin/env bash
# Creates .venv (Python 3.11, the version whose torch 2.13.0 CPU wheel lies on these machines)
# and installs objckpt with every extra and the test tools, pinned by constraints.txt.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
  for cand in "${OBJCKPT_PYTHON:-}" python3.11 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 10))'; then
      echo "$cand"; return 0
    fi
  done
  echo "objckpt: need Python >= 3.10 (3.11 preferred) on PATH" >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(pick_python)
  echo "objckpt setup: creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
stamp=.venv/.objckpt-installed
want=$(cat pyproject.toml constraints.txt | cksum)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "objckpt setup: installing objckpt[all,dev,integrations,bench] into .venv (torch pinned to the CPU wheel)"
  .venv/bin/python -m pip install -q --upgrade pip
  # DS_BUILD_OPS=0: DeepSpeed installs without compiling its CUDA/C++ ops (CPU tests only).
  DS_BUILD_OPS=0 .venv/bin/python -m pip install -q -c constraints.txt -e '.[all,dev,integrations,bench]'
  echo "$want" > "$stamp"
fi
