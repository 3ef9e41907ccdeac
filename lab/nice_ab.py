"""Does `serving_nice` (router and shard replicas at nice 19 once up) cost throughput? Interleaved
A/B rounds, each system on its own fresh local Ray, closed loop at 32 clients → serving-nice.json.

python -m lab.nice_ab --index DIR [--rounds 3] [--duration 8]
One `make bench` run compares them once; run-to-run noise on this machine is larger than the
effect, so this alternates the two settings and reports every round and their medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from loadtests.bench import SERVE_PORT, Bench
from loadtests.record import new_record, save
from shardserve.data.datasets import load_dataset

SETTINGS = {"nice19": 19, "ray-nice15": 0}  # 0: replicas keep the nice 15 Ray starts workers at


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", required=True)
    cli.add_argument("--rounds", type=int, default=3)
    cli.add_argument("--duration", type=float, default=8.0)
    cli.add_argument("--nprobe", type=int, default=16)
    args = cli.parse_args()
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()
    from ray import serve

    from deployments.run import deploy
    from shardserve.runtime.ray_session import ensure_ray, shutdown_ray

    queries = load_dataset("fashion-mnist").queries
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(queries, 10, {"nprobe": args.nprobe}, args.duration, Path(tmp))
        for round_number in range(args.rounds):
            order = list(SETTINGS.items()) if round_number % 2 == 0 else list(SETTINGS.items())[::-1]
            for label, nice in order:
                if not ensure_ray(serving_node=True):
                    raise SystemExit("error: needs its own Ray, and one is already running here")
                try:
                    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
                    url = deploy(args.index, port=SERVE_PORT, app_name="nice", serving_nice=nice)
                    bench.warm_up(url)
                    bench.run(url, label, 32)["round"] = round_number
                finally:
                    serve.shutdown()
                    shutdown_ray()
    qps = {label: [lv["qps"] for lv in bench.levels if lv["label"] == label] for label in SETTINGS}
    medians = {label: round(statistics.median(values), 1) for label, values in qps.items()}
    summary = {"qps": qps, "median_qps": medians,
               "median_ratio_nice19_vs_ray_nice15": round(medians["nice19"] / medians["ray-nice15"], 3)}
    record = new_record("serving-nice", bench.levels, {"uri": args.index, "params": {"nprobe": args.nprobe}},
                        summary=summary, rounds=args.rounds)
    print(summary)
    print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
