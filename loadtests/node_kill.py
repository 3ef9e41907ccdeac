"""Kill a worker node under load: a head + 2 worker raylets on this machine (LocalCluster), shards on
the workers, the router on the head; vegeta at a fixed rate; one worker SIGKILLed mid-run.

Shows: answers on the multi-node cluster equal single-node (in-process) answers; during the outage
every request still gets 200 (coverage says how many shards answered) or 503, none is lost; Serve
restarts the lost shards on the surviving worker and full coverage returns.

python -m loadtests.node_kill --index indexes/fashion-mnist-ivf1024-4 [--rate 100] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

from loadtests.during import BackgroundLoad, ReplicaWatcher, tally
from loadtests.local_cluster import LocalCluster
from loadtests.record import RECORDS, header, index_info, save
from shardserve.data.datasets import load_dataset
from shardserve.runtime.background import run_on_loop

HTTP_PORT = 18500
WORKERS: list[dict[str, float]] = [{"shard_host": 4, "node_w1": 1}, {"shard_host": 4, "node_w2": 1}]


def shard_placement(app: str) -> dict[str, str]:
    """shard name → worker name (node_w1 / node_w2 / head), asked of the shards themselves."""
    import ray
    from ray import serve

    from deployments.config import INDEX_INGRESS, index_app_name

    async def infos() -> dict:
        return await serve.get_deployment_handle(INDEX_INGRESS, index_app_name(app)).info.remote()

    by_node = {n["NodeID"]: next((r for r in n["Resources"] if r.startswith("node_w")), "head")
               for n in ray.nodes() if n["Alive"]}
    return {s["name"]: by_node.get(s["node_id"], "?") for s in run_on_loop(infos(), timeout_s=60)["shards"]}


def answers_equal_single_node(url: str, index: str, queries: np.ndarray, params: dict) -> bool:
    from serving.evaluate import sharded_search
    from shardserve.query.searcher import load_all_shards

    manifest, searchers = load_all_shards(index)
    _, expected = sharded_search(searchers, queries, 10, params, manifest.metric)
    response = httpx.post(f"{url}/v1/search", timeout=60, content=orjson.dumps(
        {"vectors": queries, "k": 10, "params": params}, option=orjson.OPT_SERIALIZE_NUMPY))
    response.raise_for_status()
    return [r["ids"] for r in response.json()["results"]] == expected.tolist()


def node_kill_run(index: str, rate: float = 100.0, duration_s: float = 30.0, lead_s: float = 5.0,
                  params: dict | None = None) -> dict:
    params = params if params is not None else {"nprobe": 16}
    queries = load_dataset("fashion-mnist", num_queries=1000).queries
    with LocalCluster(workers=WORKERS) as cluster:
        os.environ.update(cluster.driver_env())
        import ray

        from deployments.run import deploy

        ray.init(address=cluster.address, log_to_driver=False)
        try:
            url = deploy(index, port=HTTP_PORT, shard_resources={"shard_host": 1},
                         router_resources={"shardserve_head": 0.01}, shard_num_cpus=0.25)
            placement_before = shard_placement("shardserve")
            equal = answers_equal_single_node(url, index, queries[:64], params)
            victim = 2
            lost_shards = sorted(s for s, node in placement_before.items() if node == f"node_w{victim}")
            events: dict[str, float] = {}
            watcher = ReplicaWatcher("shardserve").__enter__()
            with tempfile.TemporaryDirectory() as work:
                load = BackgroundLoad(url, queries, rate, duration_s, Path(work), params)
                with load:
                    time.sleep(lead_s)
                    events["worker_killed"] = time.time()
                    cluster.kill_worker(victim)
                hits = load.results()
            deadline = time.monotonic() + 120  # after the load: wait for Serve to finish recovering
            while (time.monotonic() < deadline
                   and httpx.get(f"{url}/v1/health", timeout=10).status_code != 200):
                time.sleep(1)
            watcher.__exit__(None, None, None)
            placement_after = shard_placement("shardserve")
            result = tally(hits, events)
            record = {
                **header("node-kill"), "index": index_info(url),
                "cluster": {"nodes": "head (router, pointer, HAProxy) + 2 worker raylets (shards)",
                            "workers": WORKERS, "killed": f"node_w{victim} (SIGKILL raylet + workers)",
                            "shards_on_killed_node": lost_shards},
                "placement_before": placement_before, "placement_after": placement_after,
                "answers_equal_single_node": equal,
                "load": {"rate": rate, "duration_s": duration_s, "params": params,
                         "not_covered": "one open-loop rate, single-vector queries, loopback only; a "
                                        "head-node failure (router, Serve controller) is not tested"},
                "result": result, "restored_s": restored_after(result),
                "replicas_timeline": [{"t": round(r["t"] - events["worker_killed"], 1),
                                       **{k: v for k, v in r.items() if k != "t"}} for r in watcher.samples],
            }
            return record
        finally:
            ray.shutdown()  # the whole cluster is stopped next: no Serve teardown to wait for


def restored_after(result: dict) -> float | None:
    """Seconds from the kill to the start of the first second after which every answer was a
    full-coverage 200 (None if the load ended before that)."""
    killed = result["events_s"]["worker_killed"]
    degraded = [s["second"] for s in result["timeline"]
                if s.get("partial") or any(code != "200" for code in s if code.isdigit())]
    if not degraded:
        return 0.0
    last = max(degraded)
    if last >= result["timeline"][-1]["second"]:
        return None
    return round(last + 1 - killed, 1)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", required=True)
    cli.add_argument("--rate", type=float, default=100.0)
    cli.add_argument("--duration", type=float, default=30.0)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--out", default=str(RECORDS))
    args = cli.parse_args()
    record = node_kill_run(os.path.abspath(args.index), args.rate, args.duration,
                           params={"nprobe": args.nprobe})
    out = save(record, Path(args.out))
    r = record["result"]
    print(f"{out}: {r['requests']} requests, status {r['status_codes']}, coverage {r['coverage']}, "
          f"lost {r['lost']}, full coverage restored {record['restored_s']} s after the kill; "
          f"answers equal single-node: {record['answers_equal_single_node']}")


if __name__ == "__main__":
    main()
