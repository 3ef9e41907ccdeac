"""A full garbage collection of a serving replica's heap, with and without `heap.settle()`.

python -m lab.gc_pause

Imports what a replica imports (Ray Serve, FAISS, the router and shard deployments), then times
`gc.collect()` five times as it stands, and five times after `shardserve.runtime.heap.settle()`.
In-process, no Ray started. Record: loadtests/records/gc-pause.json.
"""

from __future__ import annotations

import gc
import statistics
import time

from loadtests.record import header, save


def _collect_ms(rounds: int = 5) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        gc.collect()
        times.append(round((time.perf_counter() - started) * 1000, 3))
    return times


def main() -> None:
    import deployments.router  # noqa: F401  # what a replica imports
    import deployments.shard  # noqa: F401
    from shardserve.runtime.heap import settle

    tracked = len(gc.get_objects())
    before = _collect_ms()
    frozen = settle()
    after = _collect_ms()
    record = header("gc-pause", tool=None, tracked_objects=tracked, frozen_objects=frozen,
                    full_collection_ms={"as_started": before, "after_settle": after},
                    median_ms={"as_started": statistics.median(before),
                               "after_settle": statistics.median(after)})
    print(save(record, plot_levels=False))
    print(record["median_ms"])


if __name__ == "__main__":
    main()
