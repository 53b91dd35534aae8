#!/bin/bash
# LocalStack "ready" hook: create the bucket the objckpt test suite and demo use.
# Runs inside the LocalStack container (docker-compose.yml mounts this folder at
# /etc/localstack/init/ready.d) or in host mode (LocalStackServer(init_dir="localstack/init")).
# Idempotent: an existing bucket is fine.
set -euo pipefail

BUCKET="${OBJCKPT_TEST_BUCKET:-objckpt-test}"
# GATEWAY_LISTEN is e.g. "0.0.0.0:4566" or "127.0.0.1:4566,..."; talk to its first port locally.
LISTEN="${GATEWAY_LISTEN:-127.0.0.1:4566}"
PORT="${LISTEN%%,*}"
PORT="${PORT##*:}"
ENDPOINT="http://127.0.0.1:${PORT}"
export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-test}" AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-test}"
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"

if command -v awslocal >/dev/null 2>&1; then        # the LocalStack image ships awslocal
  awslocal s3api head-bucket --bucket "$BUCKET" 2>/dev/null || awslocal s3 mb "s3://$BUCKET"
elif command -v aws >/dev/null 2>&1; then           # host mode: awscli is in LocalStack's venv
  aws --endpoint-url "$ENDPOINT" s3api head-bucket --bucket "$BUCKET" 2>/dev/null \
    || aws --endpoint-url "$ENDPOINT" s3 mb "s3://$BUCKET"
else                                                # last resort: boto3 from LocalStack's python
  python3 - "$ENDPOINT" "$BUCKET" <<'PY'
import sys, boto3
client = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
try:
    client.create_bucket(Bucket=sys.argv[2])
except client.exceptions.BucketAlreadyOwnedByYou:
    pass
PY
fi
echo "objckpt: bucket s3://$BUCKET ready"
