"""The latency knee of a sweep: where throughput stops growing and latency starts to be queueing.

Definition (precise, so records from different days compare): with levels sorted by offered load
(concurrency or rate) and Q_max the highest throughput any level reached, the knee is the FIRST level
whose throughput is >= (1 - tolerance) x Q_max. Past it throughput is flat within `tolerance` while
latency keeps growing; in a closed loop, latency past the knee is ~ concurrency / Q_max (Little's law)
— pure queueing. `latency_growth` reports p50 at the heaviest level over p50 at the knee.
"""

from __future__ import annotations

from collections.abc import Sequence

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
