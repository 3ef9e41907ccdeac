"""2x the knee, open loop, side by side: straight into Serve vs through the shedding edge HAProxy.

python -m lab.overload --knee-rate 887 --knee-concurrency 64 [--url http://127.0.0.1:8000]
(a running shardserve; `haproxy` from Debian). Writes loadtests/records/overload-edge.json.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from loadtests.record import RECORDS, header, index_info, save
from loadtests.vegeta_run import assert_loopback, attack, make_targets, write_targets
from serving.edge import Admission, EdgeProcess
from shardserve.data.datasets import load_dataset


def overload_side_by_side(url: str, rate: float, duration_s: float, max_in_flight: int,
                          queue_timeout_ms: int = 5, edge_port: int = 18080,
                          params: dict | None = None) -> dict:
    assert_loopback(url)
    queries = load_dataset("fashion-mnist", num_queries=1000).queries
    levels = {}
    parsed = urlparse(url)
    with tempfile.TemporaryDirectory() as work_dir, EdgeProcess(
            f"{parsed.hostname}:{parsed.port or 80}", f"127.0.0.1:{edge_port}",
            Admission(max_in_flight=max_in_flight, queue_timeout_ms=max(1, queue_timeout_ms))):
        work = Path(work_dir)
        for label, target_url in (("direct", url), ("edge", f"http://127.0.0.1:{edge_port}")):
            targets = write_targets(work / f"{label}.jsonl", make_targets(queries, target_url, 10, params))
            attack(targets, "concurrency", 8, 3, work, f"{label}-warm")
            levels[label] = attack(targets, "rate", rate, duration_s, work, label)
            time.sleep(5)  # let the queue of the first run drain before the second
    return {**header("overload-edge", index=index_info(url)),
            "edge": {"max_in_flight": max_in_flight, "queue_timeout_ms": queue_timeout_ms},
            "not_covered": "one open-loop rate, single-vector queries, loopback, vegeta on the same "
                           "2 cores as the server",
            "levels": [levels["direct"], levels["edge"]]}


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--url", default="http://127.0.0.1:8000")
    cli.add_argument("--knee-rate", type=float, required=True)
    cli.add_argument("--knee-concurrency", type=int, required=True, help="edge max_in_flight")
    cli.add_argument("--multiple", type=float, default=2.0)
    cli.add_argument("--duration", type=float, default=30.0)
    cli.add_argument("--queue-timeout-ms", type=int, default=5)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--out", default=str(RECORDS))
    args = cli.parse_args()
    record = overload_side_by_side(args.url, args.multiple * args.knee_rate, args.duration,
                                   args.knee_concurrency, args.queue_timeout_ms,
                                   params={"nprobe": args.nprobe})
    out = save(record, Path(args.out), plot_levels=False)
    for level in record["levels"]:
        print(f"{level['label']:>6}: {level['requests']} requests, goodput {level['qps']} req/s, "
              f"codes {level['status_codes']}, p99 by status {level['p99_ms_by_status']}, "
              f"errors {level['errors']}")
    print(out)


if __name__ == "__main__":
    main()
