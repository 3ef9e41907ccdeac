#!/usr/bin/env bash
# Autoscaling demo: open-loop ramp low → 3x the knee → low against a running shardserve whose shards
# autoscale (see `shardserve tune`), recording replicas per deployment every second → record + PNG.
#   loadtests/autoscale.sh 700            # knee throughput in requests/s (from a sweep record)
# Env: URL (http://127.0.0.1:8000), APP (shardserve), PHASES ("0.3:15,3:20,0.3:30").
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
KNEE_RATE="${1:?usage: loadtests/autoscale.sh KNEE_RATE}"
exec "${PY:-$ROOT/.venv/bin/python}" -m loadtests.autoscale --knee-rate "$KNEE_RATE" \
  --url "${URL:-http://127.0.0.1:8000}" --app "${APP:-shardserve}" --phases "${PHASES:-0.3:15,3:20,0.3:30}"
