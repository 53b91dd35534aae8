#!/usr/bin/env bash
# Static checks the test command runs before the suite: lint and format (ruff), types (mypy,
# strict on the torch-free core) and the import layers (import-linter). Each prints what it
# checked; any failure fails the command.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin
echo "objckpt check: ruff lint";     "$PY/ruff" check objckpt tests benchmarks scripts examples
echo "objckpt check: ruff format";   "$PY/ruff" format --check objckpt tests benchmarks scripts examples
echo "objckpt check: import layers"; "$PY/lint-imports"
echo "objckpt check: mypy";          "$PY/mypy"
