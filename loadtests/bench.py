"""`make bench`: one run, one index, one query set, every rival side by side → one record.

(a) in-process FAISS on the merged (unsharded-equivalent) index: one query at a time and batched;
(b) plain uvicorn + FastAPI + FAISS, one worker per core (loadtests/baseline_server.py);
(c) a Ray Serve no-op deployment on the same cluster: the framework's floor;
(d) shardserve with 4 shards and 1 shard through the router's own HTTP door (shardserve.transport.http_front),
    single-vector and 256-vector batch requests; the same 4-shard app through Serve's HTTP ingress,
    and 4 shards with the router -> shard hop as Serve handle calls instead of shard links;
(e) the headline: the `shardserve serve` command itself, as a user starts it (its own local Ray, the
    edge with its default admission, its dashboard), against (b) at 1 and 32 clients, alternating
    for --rounds rounds, each side started afresh every round. The ratios are taken over the rounds,
    so a drift of the machine between two levels weighs on both sides alike.
Every Serve system runs on its own fresh local Ray and is measured in its steady state: after the
warm-up, once the node's warm pool of idle workers is full (filling it is start-up work: each worker's
imports cost ~1-2 s of CPU) and a quiet window, whose CPU per process class is recorded as the
system's idle cost (`idle_percent_of_a_core`).
Closed-loop vegeta levels on loopback, each bounded by --duration seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import orjson

from loadtests.baseline_server import merged_searcher
from loadtests.record import new_record, save
from loadtests.vegeta_run import attack, make_targets, vegeta, write_targets
from shardserve.data.datasets import load_dataset
from shardserve.index.indexes import prepare_vectors
from shardserve.runtime.procfs import CpuMeter

SERVE_PORT = 18000
FRONT_PORT = 18002
EDGE_PORT = 18004
BASELINE_PORT = 18100
HEADLINE = ("headline-uvicorn", "headline-served")  # level labels, `-<round>` appended


def in_process(index: str, queries: np.ndarray, k: int, params: dict) -> dict:
    """The limit: FAISS alone, same index content, no network, no framework."""
    searcher, _ = merged_searcher(index)
    prepared = prepare_vectors(queries, searcher.metric)
    faiss.omp_set_num_threads(1)
    start = time.perf_counter()
    for row in range(len(prepared)):
        searcher.search(prepared[row:row + 1], k, params, prepared=True)
    single_qps = len(prepared) / (time.perf_counter() - start)
    faiss.omp_set_num_threads(len(os.sched_getaffinity(0)))
    start = time.perf_counter()
    for chunk in range(0, len(prepared), 256):
        searcher.search(prepared[chunk:chunk + 256], k, params, prepared=True)
    batched_qps = len(prepared) / (time.perf_counter() - start)
    return {"single_qps": round(single_qps, 1), "batched256_qps": round(batched_qps, 1),
            "single_ms": round(1000 / single_qps, 3)}


def parse_cost(queries: np.ndarray) -> dict:
    """Why the router parses with orjson + numpy instead of pydantic, and what a .npy body saves:
    measured per body of one query, and of a 256-query batch (JSON vs .npy)."""
    from shardserve.query.api import SearchRequest
    from shardserve.query.parse import npy_body, parse_npy_request, parse_search_request

    body = orjson.dumps({"vector": queries[0], "k": 10}, option=orjson.OPT_SERIALIZE_NUMPY)
    batch = orjson.dumps({"vectors": queries[:256], "k": 10}, option=orjson.OPT_SERIALIZE_NUMPY)
    dim = queries.shape[1]

    one_npy, batch_npy = npy_body(queries[0]), npy_body(queries[:256])

    def per_call_us(fn, calls: int = 2000) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return round((time.perf_counter() - start) / calls * 1e6, 1)

    return {"orjson_numpy_us": per_call_us(lambda: parse_search_request(body, dim, 100, 1024)),
            "pydantic_us": per_call_us(
                lambda: np.asarray(SearchRequest.model_validate_json(body).vector, np.float32)),
            "npy_us": per_call_us(lambda: parse_npy_request(one_npy, "k=10", dim, 100, 1024)),
            "batch256_json_us": per_call_us(lambda: parse_search_request(batch, dim, 100, 1024), 50),
            "batch256_npy_us": per_call_us(lambda: parse_npy_request(batch_npy, "k=10", dim, 100, 1024))}


class Bench:
    def __init__(self, queries: np.ndarray, k: int, params: dict, duration: float, work: Path):
        self.queries, self.k, self.params, self.duration, self.work = queries, k, params, duration, work
        self.levels: list[dict] = []
        self.idle: dict[str, dict] = {}

    def warm_up(self, url: str, seconds: float = 3.0) -> None:
        """Unrecorded load first: replicas JIT their paths, connections open, old apps finish leaving."""
        targets = write_targets(self.work / "warm.jsonl", make_targets(
            self.queries, url, self.k, self.params, 0, count=200))
        attack(targets, "concurrency", 8, seconds, self.work, "warm-up")

    def steady(self, label: str, warm_workers: int, quiet_s: float = 10.0) -> None:
        """Wait until the node's warm pool holds `warm_workers` idle workers (at most 60 s), then
        record `quiet_s` of idle CPU per process class: what the system costs while serving nothing."""
        from loadtests.autoscale import pooled_on_this_node, wait_until_pooled

        wait_until_pooled(warm_workers, timeout_s=60.0)
        meter = CpuMeter(include_self=True)
        meter.start()
        time.sleep(quiet_s)
        self.idle[label] = {cls: round(100 * cpu / quiet_s, 2) for cls, cpu in sorted(meter.stop().items())}
        self.idle[label]["warm_pool"] = len(pooled_on_this_node())
        print(f"  {label:<28} idle % of a core: {self.idle[label]}", flush=True)

    def run(self, url: str, label: str, concurrency: int, batch: int = 0,
            extra_processes: dict[str, int] | None = None, npy: bool = False) -> dict:
        targets = write_targets(self.work / f"{label}.jsonl", make_targets(
            self.queries, url, self.k, self.params, batch, count=20 if batch else 1000, npy=npy))
        level = attack(targets, "concurrency", concurrency, self.duration, self.work, label,
                       queries_per_request=batch or 1, meter=CpuMeter(extra_processes, include_self=True))
        self.levels.append(level)
        print(f"  {label:<28} c={concurrency:<3} {level['qps']:8.1f} req/s {level['queries_per_s']:9.1f} q/s"
              f"  p50 {level['p50_ms']:7.2f} ms  p99 {level['p99_ms']:7.2f} ms  compute p50 "
              f"{level['compute_p50_ms']}  codes {level['status_codes']}", flush=True)
        print(f"    CPU ms/request: {level.get('cpu_ms_per_request')}", flush=True)
        return level


def _wait_http(url: str, timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not come up")


@contextlib.contextmanager
def baseline_server(index: str) -> Iterator[tuple[str, dict[str, int]]]:
    """The uvicorn + FAISS monolith on `index`, up and answering: (its URL, its process tree)."""
    url = f"http://127.0.0.1:{BASELINE_PORT}"
    process = subprocess.Popen([sys.executable, "-m", "loadtests.baseline_server", index,
                                "--port", str(BASELINE_PORT)], start_new_session=True)
    try:
        _wait_http(url + "/v1/health")
        yield url, {"baseline (uvicorn)": process.pid}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def run_baseline(bench: Bench, index: str) -> None:
    with baseline_server(index) as (url, servers):
        bench.warm_up(url)
        bench.run(url, "baseline-uvicorn", 1, extra_processes=servers)
        bench.run(url, "baseline-uvicorn", 32, extra_processes=servers)
        bench.run(url, "baseline-uvicorn-npy", 32, extra_processes=servers, npy=True)


@contextlib.contextmanager
def served(index: str, log: Path, flags: tuple[str, ...] = ()) -> Iterator[str]:
    """`shardserve serve INDEX [FLAGS]` exactly as a user starts it (only the port differs from the
    default), healthy; stopped with Ctrl-C afterwards, as the admission run stops it
    (loadtests.shedding.ctrl_c: SIGINT to its session, then its processes given time to leave)."""
    from deployments.run import wait_until_healthy
    from loadtests.shedding import ctrl_c
    from shardserve.runtime.ray_private import local_cluster_running

    if local_cluster_running():
        raise SystemExit("error: the headline needs `shardserve serve` to start its own Ray; stop the "
                         "local one first")
    url = f"http://127.0.0.1:{EDGE_PORT}"
    with log.open("ab") as sink:
        process = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", index,
                                    "--port", str(EDGE_PORT), *flags], stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        wait_until_healthy(url, timeout_s=300)
        yield url
    finally:
        ctrl_c(process)


def run_headline(bench: Bench, index: str, rounds: int) -> None:
    """(e): per round, the monolith and `shardserve serve`, in alternating order, each started
    afresh, at 1 and then 32 clients."""
    from deployments.config import AppArgs

    def monolith(round_number: int) -> None:
        with baseline_server(index) as (url, servers):
            bench.warm_up(url)
            for clients in (1, 32):
                bench.run(url, f"{HEADLINE[0]}-{round_number}", clients, extra_processes=servers)

    def shardserve_serve(round_number: int) -> None:
        with served(index, bench.work / "serve.log") as url:
            bench.warm_up(url)
            bench.steady(f"{HEADLINE[1]}-{round_number}", AppArgs(index=index).warm_workers)
            for clients in (1, 32):
                bench.run(url, f"{HEADLINE[1]}-{round_number}", clients)

    for round_number in range(rounds):
        sides = (monolith, shardserve_serve) if round_number % 2 == 0 else (shardserve_serve, monolith)
        for side in sides:
            side(round_number)


def _server_cpu(level: dict) -> float:
    return level.get("cpu_ms_per_request", {}).get("total (servers)", float("nan"))


def headline(levels: list[dict]) -> dict:
    """(e) over its rounds, per side: mean queries/s at 32 clients, CPU per request over all of its
    requests, the median p50 at one client, the lowest success ratio; and each round's own ratios."""
    def side(prefix: str, clients: int) -> list[dict]:
        return [lv for lv in levels if lv["label"].startswith(prefix + "-") and lv["value"] == clients]

    summary: dict[str, Any] = {}
    for prefix in HEADLINE:
        wide, one = side(prefix, 32), side(prefix, 1)
        summary[prefix] = {
            "rounds": len(wide),
            "qps_c32": round(statistics.mean(lv["qps"] for lv in wide), 1),
            "cpu_ms_per_request_c32": round(sum(_server_cpu(lv) * lv["requests"] for lv in wide)
                                            / sum(lv["requests"] for lv in wide), 3),
            "p99_ms_c32": round(statistics.median(lv["p99_ms"] for lv in wide), 3),
            "success_c32": min(lv["success_ratio"] for lv in wide),
            "p50_ms_c1": round(statistics.median(lv["p50_ms"] for lv in one), 3)}
    ours, theirs = summary[HEADLINE[1]], summary[HEADLINE[0]]
    summary["per_round"] = [
        {"round": n, "qps_c32_vs_uvicorn": round(a32["qps"] / b32["qps"], 3),
         "cpu_per_request_c32_vs_uvicorn": round(_server_cpu(a32) / _server_cpu(b32), 3),
         "c1_p50_minus_uvicorn_c1_p50_ms": round(a1["p50_ms"] - b1["p50_ms"], 3)}
        for n, (a32, b32, a1, b1) in enumerate(zip(side(HEADLINE[1], 32), side(HEADLINE[0], 32),
                                                   side(HEADLINE[1], 1), side(HEADLINE[0], 1), strict=True))]
    summary["ratios"] = {
        "qps_c32_vs_uvicorn": round(ours["qps_c32"] / theirs["qps_c32"], 3),
        "cpu_per_request_c32_vs_uvicorn": round(ours["cpu_ms_per_request_c32"]
                                                / theirs["cpu_ms_per_request_c32"], 3),
        "success_c32": ours["success_c32"],
        "c1_p50_minus_uvicorn_c1_p50_ms": round(ours["p50_ms_c1"] - theirs["p50_ms_c1"], 3)}
    return summary


def run_serve(bench: Bench, index_4: str, index_1: str) -> None:
    """Each Serve system on a fresh local Ray: measured here, a Ray that had already served (and
    deleted) other apps gave the next app up to ~1.5x less throughput, whichever came second.
    Every shardserve app is driven at the router's front door; the 4-shard app also through Serve's
    HTTP ingress, on the same deployment (the edge is measured on `shardserve serve` itself: (e))."""
    from ray import serve

    from deployments.config import AppArgs
    from deployments.noop import NoopDeployment
    from deployments.run import deploy
    from shardserve.runtime.ray_session import ensure_ray, shutdown_ray

    front = f"http://127.0.0.1:{FRONT_PORT}"
    systems: list[tuple[str, str | None, dict[str, Any]]] = [
        ("shardserve-4shard", index_4, {}), ("shardserve-1shard", index_1, {}),
        ("shardserve-4shard-serve-calls", index_4, {"shard_transport": "serve"}), ("serve-noop", None, {})]
    for label, index, overrides in systems:
        started = ensure_ray(serving_node=True)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
            if index is None:
                serve.run(NoopDeployment.bind(), name="noop", route_prefix="/noop")  # type: ignore[attr-defined]
                url = f"http://127.0.0.1:{SERVE_PORT}/noop"
                _wait_http(url + "/v1/health")
            else:
                serve_http = deploy(index, port=SERVE_PORT, app_name="bench", front_port=FRONT_PORT,
                                    **overrides)
                url = front
            bench.warm_up(url)
            bench.steady(label, 0 if index is None else AppArgs(index=index, **overrides).warm_workers)
            bench.run(url, label, 1)
            bench.run(url, label, 32)
            if label in ("shardserve-4shard", "shardserve-1shard"):
                bench.run(url, f"{label}-batch256", 2, batch=256)
            if label == "shardserve-4shard":
                bench.run(url, f"{label}-npy", 32, npy=True)  # the same queries as .npy bodies
                bench.run(url, f"{label}-batch256-npy", 2, batch=256, npy=True)
                bench.run(serve_http, f"{label}-serve-http", 1)
                bench.run(serve_http, f"{label}-serve-http", 32)
        finally:
            if started:  # ending our own Ray ends its apps; serve.shutdown() first waited 30 s
                shutdown_ray()
            else:
                serve.shutdown()


def _level(levels: list[dict], label: str, concurrency: int) -> dict:
    return next(lv for lv in levels if lv["label"] == label and lv["value"] == concurrency)


def ratios(levels: list[dict], limit: dict, served: dict) -> dict:
    # The headline is what `shardserve serve` gives a user (`served`: (e) over its rounds). `direct`
    # is the router's door alone, on (d)'s deployment, against (b): the second row.
    ours = _level(levels, "shardserve-4shard", 32)
    baseline = _level(levels, "baseline-uvicorn", 32)
    one = _level(levels, "shardserve-4shard", 1)
    one_shard = _level(levels, "shardserve-1shard", 1)
    batch = _level(levels, "shardserve-4shard-batch256", 2)
    ours_npy = _level(levels, "shardserve-4shard-npy", 32)
    baseline_npy = _level(levels, "baseline-uvicorn-npy", 32)
    batch_npy = _level(levels, "shardserve-4shard-batch256-npy", 2)

    return {
        **served["ratios"],
        "qps_c32_direct_vs_uvicorn": round(ours["qps"] / baseline["qps"], 3),
        "cpu_per_request_c32_direct_vs_uvicorn": round(_server_cpu(ours) / _server_cpu(baseline), 3),
        "qps_c32_vs_serve_noop": round(ours["qps"] / _level(levels, "serve-noop", 32)["qps"], 3),
        "c1_p50_minus_compute_p50_ms": round(one["p50_ms"] - (one["compute_p50_ms"] or 0.0), 3),
        "c1_1shard_p50_minus_compute_p50_ms": round(
            one_shard["p50_ms"] - (one_shard["compute_p50_ms"] or 0.0), 3),
        "batch256_vs_inprocess_batched": round(batch["queries_per_s"] / limit["batched256_qps"], 3),
        "batch256_npy_vs_inprocess_batched": round(batch_npy["queries_per_s"] / limit["batched256_qps"], 3),
        "qps_c32_npy_vs_uvicorn_npy": round(ours_npy["qps"] / baseline_npy["qps"], 3),
        "cpu_per_request_c32_npy_vs_uvicorn_npy": round(_server_cpu(ours_npy) / _server_cpu(baseline_npy), 3),
        "qps_c32_links_vs_serve_calls": round(
            ours["qps"] / _level(levels, "shardserve-4shard-serve-calls", 32)["qps"], 3),
        "cpu_per_request_c32_links_vs_serve_calls": round(
            _server_cpu(ours) / _server_cpu(_level(levels, "shardserve-4shard-serve-calls", 32)), 3),
        "c1_p50_serve_calls_minus_links_ms": round(
            _level(levels, "shardserve-4shard-serve-calls", 1)["p50_ms"] - one["p50_ms"], 3),
        "qps_c32_front_vs_serve_http": round(
            ours["qps"] / _level(levels, "shardserve-4shard-serve-http", 32)["qps"], 3),
        "cpu_per_request_c32_front_vs_serve_http": round(
            _server_cpu(ours) / _server_cpu(_level(levels, "shardserve-4shard-serve-http", 32)), 3),
        "c1_p50_serve_http_minus_front_ms": round(
            _level(levels, "shardserve-4shard-serve-http", 1)["p50_ms"] - one["p50_ms"], 3),
    }


# The hot-path targets, on what `shardserve serve` gives a user (edge included): a sharded query
# costs no more than the monolith, every closed-loop request is answered, and one client over one
# kept-alive connection waits at most 0.5 ms longer than on the monolith (same client, same queries).
TARGETS = {"qps_c32_vs_uvicorn": (">=", 1.0), "cpu_per_request_c32_vs_uvicorn": ("<=", 1.0),
           "success_c32": (">=", 1.0), "c1_p50_minus_uvicorn_c1_p50_ms": ("<=", 0.5),
           # the router's own door without the edge, on (d)'s deployment (not what users get)
           "qps_c32_direct_vs_uvicorn": (">=", 1.0), "cpu_per_request_c32_direct_vs_uvicorn": ("<=", 1.0),
           "qps_c32_vs_serve_noop": (">=", 0.5), "c1_p50_minus_compute_p50_ms": ("<=", 2.0),
           "c1_1shard_p50_minus_compute_p50_ms": ("<=", 1.0),
           "batch256_vs_inprocess_batched": (">=", 0.8),
           # the same, with .npy request bodies (both servers parse them; in-process parses nothing)
           "batch256_npy_vs_inprocess_batched": (">=", 0.8),
           "qps_c32_npy_vs_uvicorn_npy": (">=", 1.0), "cpu_per_request_c32_npy_vs_uvicorn_npy": ("<=", 1.0),
           # shard links (shardserve.transport.shard_link) against Serve handle calls for the same hop
           "qps_c32_links_vs_serve_calls": (">=", 1.0),
           "cpu_per_request_c32_links_vs_serve_calls": ("<=", 1.0),
           "c1_p50_serve_calls_minus_links_ms": (">=", 0.0),
           # the router's own HTTP door against Serve's HTTP ingress for the same app
           "qps_c32_front_vs_serve_http": (">=", 1.0),
           "cpu_per_request_c32_front_vs_serve_http": ("<=", 1.0),
           "c1_p50_serve_http_minus_front_ms": (">=", 0.0)}


def checked(measured: dict, targets: dict) -> dict:
    """Each targeted ratio's value, its target ("op bound") and whether it is met."""
    return {name: {"value": measured[name], "target": f"{op} {bound}",
                   "met": measured[name] >= bound if op == ">=" else measured[name] <= bound}
            for name, (op, bound) in targets.items()}


def index_fields(manifest: Any, params: dict) -> dict:
    """What a bench record says of the index it ran on."""
    return {"version": manifest.index_version, "factory": manifest.index_factory,
            "shards": len(manifest.shards), "replicas": 1, "params": params}


def bench_cli(description: str | None, name: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments every part of `make bench` takes."""
    cli = argparse.ArgumentParser(description=description)
    cli.add_argument("--index", required=True, help="the 4-shard index directory")
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--k", type=int, default=10)
    cli.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    cli.add_argument("--rounds", type=int, default=rounds, help="rounds of each side, alternating")
    cli.add_argument("--name", default=name)
    return cli


def main() -> None:
    args = bench_cli(__doc__, "bench", 2).parse_args()
    vegeta()  # built, or say what to run before anything starts
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()  # before ray.serve is imported anywhere in this process

    from index_build.job import build_index
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location

    manifest = read_manifest(Location.parse(args.index))
    queries = load_dataset(args.dataset).queries
    params = {"nprobe": args.nprobe} if args.nprobe else {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("(a) in-process FAISS", flush=True)
        limit = in_process(args.index, queries[:2000], args.k, params)
        limit["parse_cost"] = parse_cost(queries)
        print(f"  {limit}", flush=True)
        bench = Bench(queries, args.k, params, args.duration, work)
        print("(b) uvicorn + FastAPI + FAISS baseline", flush=True)
        run_baseline(bench, args.index)
        one_shard = str(work / "one-shard")
        build_index(args.dataset, 1, manifest.index_factory, one_shard,
                    limit=manifest.num_vectors, backend="local",
                    seed=manifest.build.params.get("seed", 1234))
        print("(d, c) shardserve 4 and 1 shards, then the Ray Serve no-op", flush=True)
        run_serve(bench, os.path.abspath(args.index), one_shard)
        print(f"(e) the headline: `shardserve serve` and (b), alternating, {args.rounds} rounds", flush=True)
        run_headline(bench, os.path.abspath(args.index), args.rounds)
        summary = headline(bench.levels)
    measured = ratios(bench.levels, limit, summary)
    checks = checked(measured, TARGETS)
    record = new_record(args.name, bench.levels, index_fields(manifest, params),
                        baselines={"in_process": limit}, headline=summary, ratios=checks,
                        idle_percent_of_a_core=bench.idle,
                        not_covered=["open-loop overload (see sweep.sh -r / autoscaling issue)",
                                     "multi-node fan-out", "replica failure during load",
                                     "bodies other than Fashion-MNIST test queries"])
    path = save(record)
    print("\nratio                               value   target   met")
    for name, check in checks.items():
        print(f"{name:<34} {check['value']:>7}   {check['target']:<7}  {check['met']}")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
