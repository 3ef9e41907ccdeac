#!/usr/bin/env bash
# Sweep closed-loop concurrency (default) or open-loop rates; each level bounded by DURATION seconds.
#   loadtests/sweep.sh                         # concurrency 1 2 4 8 16 32 64
#   loadtests/sweep.sh -r "100 200 400 800"    # open-loop rates
# Writes loadtests/records/NAME.json (levels + knee), NAME.png, and a vegeta HTML plot per level.
set -euo pipefail
source "$(dirname "$0")/common.sh"
MODE=concurrency; VALUES="1 2 4 8 16 32 64"
while getopts "c:r:d:n:" opt; do
  case "$opt" in
    c) MODE=concurrency; VALUES="$OPTARG" ;;
    r) MODE=rate; VALUES="$OPTARG" ;;
    d) DURATION="$OPTARG" ;;
    n) NAME="$OPTARG" ;;
    *) sed -n '2,5p' "$0"; exit 2 ;;
  esac
done
NAME="${NAME:-sweep-$MODE-$(date -u +%Y%m%dT%H%M%SZ)}"; OUT="${OUT:-$ROOT/loadtests/records}"
mkdir -p "$OUT"
make_targets
for value in $VALUES; do
  echo "level $MODE=$value (${DURATION}s)" >&2
  run_level "$MODE" "$value"
done
write_record
