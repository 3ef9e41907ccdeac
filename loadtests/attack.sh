#!/usr/bin/env bash
# One bounded load level against a running shardserve (loopback only) → record JSON + vegeta HTML.
#   loadtests/attack.sh -c 32            # closed loop, 32 concurrent clients, 10 s
#   loadtests/attack.sh -r 500 -d 20     # open loop, 500 requests/s for 20 s
# Env: URL (http://127.0.0.1:8000) DATASET K NPROBE BATCH (vectors per request, 0 = single) OUT NAME
set -euo pipefail
source "$(dirname "$0")/common.sh"
MODE=concurrency; VALUE=8
while getopts "c:r:d:n:" opt; do
  case "$opt" in
    c) MODE=concurrency; VALUE="$OPTARG" ;;
    r) MODE=rate; VALUE="$OPTARG" ;;
    d) DURATION="$OPTARG" ;;
    n) NAME="$OPTARG" ;;
    *) sed -n '2,6p' "$0"; exit 2 ;;
  esac
done
NAME="${NAME:-attack-$MODE-$VALUE-$(date -u +%Y%m%dT%H%M%SZ)}"; OUT="${OUT:-$ROOT/loadtests/records}"
mkdir -p "$OUT"
make_targets
run_level "$MODE" "$VALUE"
write_record
