#!/usr/bin/env bash
# The one command that installs everything and runs the whole test suite (CI runs exactly this).
#
# Servers the tests need are started by the suite itself on 127.0.0.1 and stopped at the end,
# also when tests fail: moto server (S3), fake-gcs-server (GCS) and, when scripts/localstack.sh
# could install it, LocalStack in host mode (the faithful S3). Extra arguments go to pytest,
# e.g. `scripts/test.sh -m "not slow" tests/store`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Lint, format, types and import layers first: a red check fails the run before the suite.
bash scripts/check.sh
if [ "${OBJCKPT_SKIP_LOCALSTACK:-0}" != "1" ]; then
  # Best effort: without it the LocalStack legs skip, saying why; everything else still runs.
  bash scripts/localstack.sh || echo "objckpt test: LocalStack could not be installed; its tests will be skipped"
fi
exec .venv/bin/python -m pytest "$@"
