"""Turn vegeta results into one record level: QPS, status codes, latency percentiles, and the split of
latency into server compute (from each response's `timing_ms.compute`) and interface + queue.

Reads `vegeta encode` JSON lines (one per request, response body base64) from a file or stdin.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime

import numpy as np


def summarize(lines: Iterable[str], mode: str, value: float, duration_s: float,
              queries_per_request: int = 1) -> dict:
    """One `levels[]` entry of the records contract."""
    latencies, computes, server_totals, interface, batches = [], [], [], [], []
    by_code: dict[str, list[float]] = {}
    codes: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    shed_without_retry_after = 0
    first = last = None
    for line in lines:
        if not line.strip():
            continue
        hit = json.loads(line)
        codes[str(hit["code"])] += 1
        if hit.get("error"):
            errors[hit["error"][:120]] += 1
        latency_ms = hit["latency"] / 1e6
        latencies.append(latency_ms)
        by_code.setdefault(str(hit["code"]), []).append(latency_ms)
        if hit["code"] == 503 and not {k.lower() for k in (hit.get("headers") or {})} & {"retry-after"}:
            shed_without_retry_after += 1
        stamp = parse_timestamp(hit["timestamp"])
        first = stamp if first is None else min(first, stamp)
        last = stamp + latency_ms / 1000 if last is None else max(last, stamp + latency_ms / 1000)
        if hit["code"] == 200 and hit.get("body"):
            payload = _payload(hit["body"])
            timing = payload.get("timing_ms")
            if isinstance(payload.get("batch"), int):
                batches.append(payload["batch"])
            if isinstance(timing, dict):
                computes.append(timing["compute"])
                server_totals.append(timing["total"])
                interface.append(latency_ms - timing["compute"])
    requests = len(latencies)
    ok = codes.get("200", 0)
    wall = max((last - first) if first is not None and last is not None else 0.0, 1e-9)
    lat = np.asarray(latencies) if latencies else np.zeros(1)
    level = {
        "mode": mode, "value": value, "duration_s": duration_s, "requests": requests,
        "qps": round(ok / wall, 1), "queries_per_s": round(ok * queries_per_request / wall, 1),
        "success_ratio": round(ok / requests, 4) if requests else 0.0,
        "status_codes": dict(codes),
        "p50_ms": _pct(lat, 50), "p90_ms": _pct(lat, 90), "p99_ms": _pct(lat, 99),
        "max_ms": round(float(lat.max()), 3), "mean_ms": round(float(lat.mean()), 3),
        "compute_p50_ms": _pct(np.asarray(computes), 50) if computes else None,
        "compute_p99_ms": _pct(np.asarray(computes), 99) if computes else None,
        "server_total_p50_ms": _pct(np.asarray(server_totals), 50) if server_totals else None,
        # queries in the router batch each answered request rode in (shardserve's `batch` field)
        "batch_mean": round(float(np.mean(batches)), 2) if batches else None,
        # router batches per second: each answered request is queries_per_request of its batch's rows
        "batches_per_s": round(sum(queries_per_request / b for b in batches) / wall, 1) if batches else None,
        # interface + queue of each answered request = its client latency - its server compute
        "queue_p50_ms": _pct(np.asarray(interface), 50) if interface else None,
        "queue_p99_ms": _pct(np.asarray(interface), 99) if interface else None,
        "errors": dict(errors.most_common(5)),
        # accepted and shed requests have different latency stories: report them apart
        "p99_ms_by_status": {code: _pct(np.asarray(values), 99) for code, values in sorted(by_code.items())},
        "shed_without_retry_after": shed_without_retry_after,
    }
    return level


def _pct(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q)), 3) if values.size else 0.0


def _payload(body_b64: str) -> dict:
    try:
        payload = json.loads(base64.b64decode(body_b64))
    except (ValueError, json.JSONDecodeError):
        return {}
    return payload if isinstance(payload, dict) else {}


def parse_timestamp(stamp: str) -> float:
    """vegeta's RFC 3339 timestamp (nanoseconds, `Z` or an offset) -> seconds since the epoch, to
    the microsecond (only differences matter)."""
    return datetime.fromisoformat(stamp).timestamp()


# The latency knee of a sweep: where throughput stops growing and latency starts to be queueing.
# 
# Definition (precise, so records from different days compare): with levels sorted by offered load
# (concurrency or rate) and Q_max the highest throughput any level reached, the knee is the FIRST level
# whose throughput is >= (1 - tolerance) x Q_max. Past it throughput is flat within `tolerance` while
# latency keeps growing; in a closed loop, latency past the knee is ~ concurrency / Q_max (Little's law)
# — pure queueing. `latency_growth` reports p50 at the heaviest level over p50 at the knee.
DEFAULT_TOLERANCE = 0.10


def find_knee(levels: Sequence[dict], tolerance: float = DEFAULT_TOLERANCE) -> dict | None:
    """levels: dicts with `value` (load), `qps`, `p50_ms`, `p99_ms`; None if fewer than 3 levels."""
    usable = sorted((lv for lv in levels if lv.get("qps", 0) > 0), key=lambda lv: lv["value"])
    if len(usable) < 3:
        return None
    peak = max(lv["qps"] for lv in usable)
    knee = next(lv for lv in usable if lv["qps"] >= (1.0 - tolerance) * peak)
    heaviest = usable[-1]
    return {
        "mode": knee.get("mode", "concurrency"),
        "value": knee["value"],
        "qps": knee["qps"],
        "p50_ms": knee["p50_ms"],
        "p99_ms": knee["p99_ms"],
        "peak_qps": peak,
        "tolerance": tolerance,
        "latency_growth": round(heaviest["p50_ms"] / knee["p50_ms"], 2) if knee["p50_ms"] else None,
        "saturated": knee is not heaviest,
    }


def main() -> None:
    """`vegeta encode | python -m loadtests.report --mode M --value V --duration S`: one level as JSON."""
    cli = argparse.ArgumentParser(description=main.__doc__)
    cli.add_argument("--mode", choices=["rate", "concurrency"], required=True)
    cli.add_argument("--value", type=float, required=True)
    cli.add_argument("--duration", type=float, required=True)
    cli.add_argument("--queries-per-request", type=int, default=1)
    args = cli.parse_args()
    level = summarize(sys.stdin, args.mode, args.value, args.duration, args.queries_per_request)
    json.dump(level, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
