#!/usr/bin/env bash
# vegeta against a running shardserve (loopback only), each level bounded by DURATION seconds:
# closed-loop concurrency levels (default) or open-loop rates; one value is one level.
#   loadtests/sweep.sh                         # concurrency 1 2 4 8 16 32 64
#   loadtests/sweep.sh -c 32                   # one closed-loop level, 32 clients
#   loadtests/sweep.sh -r "100 200 400 800"    # open-loop rates
# Writes loadtests/records/NAME.json (levels, + the knee for 3 or more), NAME.png, and a vegeta HTML
# plot per level. Env: URL (http://127.0.0.1:8000) DATASET K NPROBE BATCH (vectors per request,
# 0 = single) DURATION OUT NAME; TEXT=1: distinct real texts instead of vectors (an index built from
# text, served with `--arg embedder_autoscaling=null --arg embedding_cache_bytes=0`: every level
# sends the same texts, so the cache is off; the knee found is the embedder's, and `shardserve
# tune` sizes the embedder from it). NPROBE=0 sends no nprobe (an index without lists).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VEGETA="${VEGETA:-$ROOT/.bin/vegeta}"
PY="${PY:-$ROOT/.venv/bin/python}"
URL="${URL:-http://127.0.0.1:8000}"
DATASET="${DATASET:-fashion-mnist}"
K="${K:-10}"; NPROBE="${NPROBE:-16}"; BATCH="${BATCH:-0}"; DURATION="${DURATION:-10}"; TEXT="${TEXT:-0}"
MODE=concurrency; VALUES="1 2 4 8 16 32 64"
while getopts "c:r:d:n:" opt; do
  case "$opt" in
    c) MODE=concurrency; VALUES="$OPTARG" ;;
    r) MODE=rate; VALUES="$OPTARG" ;;
    d) DURATION="$OPTARG" ;;
    n) NAME="$OPTARG" ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
  esac
done
[[ -x "$VEGETA" ]] || { echo "vegeta not found at $VEGETA: run 'make vegeta'" >&2; exit 1; }
case "$URL" in
  http://127.*|http://localhost*|http://\[::1\]*) ;;
  *) echo "refusing to load-test $URL: loopback targets only" >&2; exit 1 ;;
esac
NAME="${NAME:-sweep-$MODE-$(date -u +%Y%m%dT%H%M%SZ)}"; OUT="${OUT:-$ROOT/loadtests/records}"
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

# targets from real query vectors; the attack flags from loadtests/vegeta_run.py (spelled once)
if [[ "$TEXT" == 1 ]]; then  # every fortune once: a text repeats (a cache hit) only past ~15,000 requests
  "$PY" -m loadtests.vegeta_run targets --text --url "$URL" --k "$K" --nprobe "$NPROBE" \
    --count 20000 --out "$WORK/targets.jsonl" >/dev/null
else
  "$PY" -m loadtests.vegeta_run targets --dataset "$DATASET" --url "$URL" --k "$K" --nprobe "$NPROBE" \
    --batch "$BATCH" --count 2000 --out "$WORK/targets.jsonl" >/dev/null
fi
for value in $VALUES; do
  echo "level $MODE=$value (${DURATION}s)" >&2
  bin="$WORK/$MODE-$value.bin"
  mapfile -t flags < <("$PY" -m loadtests.vegeta_run flags --targets "$WORK/targets.jsonl" \
    --duration "$DURATION" --mode "$MODE" --value "$value")
  "$VEGETA" attack "${flags[@]}" > "$bin"
  "$VEGETA" plot -title "$NAME $MODE=$value" "$bin" > "$OUT/$NAME-$MODE-$value.html"
  "$VEGETA" encode --to json "$bin" | "$PY" -m loadtests.report --mode "$MODE" --value "$value" \
    --duration "$DURATION" --queries-per-request "$(( BATCH > 0 ? BATCH : 1 ))" > "$WORK/level-$MODE-$value.json"
  rm -f "$bin"
done
"$PY" -m loadtests.record --name "$NAME" --url "$URL" --out "$OUT" --queries "$([[ "$TEXT" == 1 ]] && echo text || echo vector)" \
  --vegeta-version "$("$VEGETA" -version | sed -n 's/^Version: //p')" "$WORK"/level-*.json
