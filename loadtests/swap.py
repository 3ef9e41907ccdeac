"""Index swap under load: vegeta at a fixed rate while `shardserve swap` replaces the index.

python -m loadtests.swap --url http://127.0.0.1:8000 --new-index DIR [--rate 100] [--out records/]
(the server must be running on this machine's Ray, e.g. `make demo`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from loadtests.during import BackgroundLoad, tally
from loadtests.record import RECORDS, header, index_info, save
from shardserve.data.datasets import load_dataset


def swap_under_load(url: str, new_index: str, rate: float = 100.0, duration_s: float = 20.0,
                    lead_s: float = 3.0, params: dict | None = None, **swap_options) -> dict:
    """Start the load, swap `lead_s` seconds into it, let the load finish; tally every request."""
    from deployments.swap import swap_index

    before = index_info(url)
    queries = load_dataset("fashion-mnist", num_queries=1000).queries
    events: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as work:
        load = BackgroundLoad(url, queries, rate, duration_s, Path(work), params)
        with load:
            time.sleep(lead_s)
            events["swap_started"] = time.time()
            report = swap_index(new_index, **swap_options)
            events["swap_done"] = time.time()
        hits = load.results()
    return {**header("swap-under-load"), "index_before": before, "index_after": index_info(url),
            "load": {"rate": rate, "duration_s": duration_s, "params": params or {},
                     "not_covered": "one open-loop rate, single-vector queries, loopback only; "
                                    "requests refused before vegeta sent them are not counted"},
            "swap": report, "result": tally(hits, events)}


def main() -> None:
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--url", default="http://127.0.0.1:8000")
    cli.add_argument("--new-index", required=True)
    cli.add_argument("--rate", type=float, default=100.0)
    cli.add_argument("--duration", type=float, default=20.0)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--out", default=str(RECORDS))
    args = cli.parse_args()
    import ray

    ray.init(address="auto", log_to_driver=False)
    record = swap_under_load(args.url, args.new_index, args.rate, args.duration,
                             params={"nprobe": args.nprobe})
    out = save(record, Path(args.out))
    result = record["result"]
    print(f"{out}: {result['requests']} requests, status {result['status_codes']}, "
          f"versions {result['index_versions']}, non-2xx {result['non_2xx']}")


if __name__ == "__main__":
    main()
