"""The router → shard hop, measured alone: Serve handle-call options side by side in one run.

A `Router` deployment fans a query batch out to 4 `shard-*` deployments that answer at once (no
FAISS), `--fanouts` times in a row, for each transport option and batch size; CPU per fan-out comes
from /proc for every process class. Record: loadtests/records/hop.json.

    python -m lab.hop [--fanouts 400] [--rows 14,256]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from loadtests.record import header, save
from shardserve.runtime.procfs import CpuMeter
from shardserve.transport.shard_wire import ShardQuery, decode_answer, encode_answer

SHARDS = 4
DIM = 784
K = 10
# name -> (payload kind, handle options)
VARIANTS = {
    "numpy args, cloudpickle (gRPC, Serve default here)": ("numpy", {}),
    "raw bytes, cloudpickle (gRPC)": ("bytes", {}),
    "raw bytes, pickle (gRPC)": ("bytes", {"request_serialization": "pickle",
                                           "response_serialization": "pickle"}),
    "numpy args, by reference (Ray actor call)": ("numpy", {"_by_reference": True}),
    "raw bytes, by reference (Ray actor call)": ("bytes", {"_by_reference": True}),
}


def _deployments():
    from ray import serve

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.1})
    class HopShard:
        """Answers like a shard (a k-wide answer per query row) without searching."""

        async def search(self, query: bytes) -> bytes:
            n = ShardQuery.rows(query)
            return encode_answer(np.zeros((n, K), np.float32), np.zeros((n, K), np.int64), 0.0)

        async def search_numpy(self, matrix: np.ndarray, k: int, params: dict):
            return np.zeros((len(matrix), k), np.float32), np.zeros((len(matrix), k), np.int64), 0.0

    @serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.1})
    class Router:
        def __init__(self, *shards):
            self.shards = shards

        async def run(self, variant: str, fanouts: int, rows: int) -> dict:
            kind, options = VARIANTS[variant]
            method = "search" if kind == "bytes" else "search_numpy"
            handles = [shard.options(method_name=method, **options) for shard in self.shards]
            matrix = np.random.default_rng(0).standard_normal((rows, DIM)).astype(np.float32)
            walls = []
            for _ in range(fanouts):
                started = time.perf_counter()
                if kind == "bytes":
                    blob = ShardQuery(matrix, K, {"nprobe": 16}).encode()
                    answers = await asyncio.gather(*[h.remote(blob) for h in handles])
                    [decode_answer(a) for a in answers]
                else:
                    await asyncio.gather(*[h.remote(matrix, K, {"nprobe": 16}) for h in handles])
                walls.append((time.perf_counter() - started) * 1000)
            return {"wall_ms_p50": round(statistics.median(walls), 3),
                    "wall_ms_mean": round(statistics.fmean(walls), 3)}

    shards = [HopShard.options(name=f"shard-{i:03d}").bind() for i in range(SHARDS)]
    return Router.bind(*shards)


def measure(fanouts: int, rows_list: list[int], port: int) -> list[dict]:
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(_deployments(), name="hop", route_prefix=None)
    return asyncio.run(_measure_all(fanouts, rows_list))


async def _measure_all(fanouts: int, rows_list: list[int]) -> list[dict]:
    """On an event loop: Serve's throughput-optimised handles are used from one."""
    from ray import serve

    router = serve.get_app_handle("hop")
    results = []
    for rows in rows_list:
        for variant in VARIANTS:
            await router.run.remote(variant, 20, rows)  # warm-up: connections, code paths
            meter = CpuMeter()
            meter.start()
            timing = await router.run.remote(variant, fanouts, rows)
            cpu = meter.stop()
            cpu_ms = {name: round(seconds * 1000 / fanouts, 3) for name, seconds in sorted(cpu.items())}
            cpu_ms["total"] = round(sum(cpu_ms.values()), 3)
            results.append({"variant": variant, "rows": rows, "fanout": SHARDS, **timing,
                            "cpu_ms_per_fanout": cpu_ms})
            print(f"rows={rows:<4} {variant:<48} wall p50 {timing['wall_ms_p50']:6.2f} ms  "
                  f"CPU {cpu_ms['total']:6.2f} ms/fan-out", flush=True)
    await serve.shutdown_async()  # on this loop: its handles live here
    return results


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--fanouts", type=int, default=400)
    cli.add_argument("--rows", default="14,256", help="query rows per batch (message size)")
    cli.add_argument("--port", type=int, default=18700)
    args = cli.parse_args()
    from shardserve.runtime.ray_session import apply_serving_node_env, ensure_ray, shutdown_ray

    apply_serving_node_env()
    started = ensure_ray(serving_node=True)
    try:
        results = measure(args.fanouts, [int(r) for r in args.rows.split(",")], args.port)
        _save(args, results)
    finally:
        if started:
            shutdown_ray()


def _save(args: argparse.Namespace, results: list[dict]) -> None:
    best = {rows: min((r for r in results if r["rows"] == rows),
                      key=lambda r: r["cpu_ms_per_fanout"]["total"])
            for rows in {r["rows"] for r in results}}
    record = header("hop", tool=None, fanouts=args.fanouts, shards=SHARDS, dim=DIM, k=K, results=results,
                    lowest_cpu={str(rows): r["variant"] for rows, r in best.items()},
                    not_covered=["real FAISS work on the shards (see bench.json)", "multi-node hops",
                                 "concurrent fan-outs (one in flight at a time)"])
    print(f"record: {save(record)}")


if __name__ == "__main__":
    main()
