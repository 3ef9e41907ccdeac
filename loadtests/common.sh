# Shared by attack.sh and sweep.sh: paths, loopback guard, targets, one vegeta level.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VEGETA="${VEGETA:-$ROOT/.bin/vegeta}"
PY="${PY:-$ROOT/.venv/bin/python}"
URL="${URL:-http://127.0.0.1:8000}"
DATASET="${DATASET:-fashion-mnist}"
K="${K:-10}"; NPROBE="${NPROBE:-16}"; BATCH="${BATCH:-0}"; DURATION="${DURATION:-10}"
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT

[[ -x "$VEGETA" ]] || { echo "vegeta not found at $VEGETA: run 'make vegeta'" >&2; exit 1; }
case "$URL" in
  http://127.*|http://localhost*|http://\[::1\]*) ;;
  *) echo "refusing to load-test $URL: loopback targets only" >&2; exit 1 ;;
esac

make_targets() {  # → $WORK/targets.jsonl from real query vectors
  "$PY" -m loadtests.targets --dataset "$DATASET" --url "$URL" --k "$K" --nprobe "$NPROBE" \
    --batch "$BATCH" --count 2000 --out "$WORK/targets.jsonl" >/dev/null
}

run_level() {  # run_level MODE VALUE → $WORK/level-MODE-VALUE.json (+ vegeta plot HTML in $OUT)
  local mode="$1" value="$2" bin="$WORK/$1-$2.bin" flags
  # The flags come from loadtests/vegeta_run.py: spelled once, for Python and shell alike.
  mapfile -t flags < <("$PY" -m loadtests.vegeta_run --targets "$WORK/targets.jsonl" \
    --duration "$DURATION" --mode "$mode" --value "$value")
  "$VEGETA" attack "${flags[@]}" > "$bin"
  "$VEGETA" plot -title "$NAME $mode=$value" "$bin" > "$OUT/$NAME-$mode-$value.html"
  "$VEGETA" encode --to json "$bin" | "$PY" -m loadtests.report --mode "$mode" --value "$value" \
    --duration "$DURATION" --queries-per-request "$(( BATCH > 0 ? BATCH : 1 ))" > "$WORK/level-$mode-$value.json"
  rm -f "$bin"
}

write_record() {
  "$PY" -m loadtests.record --name "$NAME" --url "$URL" --out "$OUT" \
    --vegeta-version "$("$VEGETA" -version | sed -n 's/^Version: //p')" "$WORK"/level-*.json
}
