#!/usr/bin/env bash
# Sets up .venv, then runs the demo: 4 ranks train on CPU, checkpoint to an embedded S3 endpoint
# (moto server on 127.0.0.1), one rank is killed, the job restarts and resumes, and the resumed
# run is checked bit for bit against an uninterrupted one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/objckpt demo "$@"
