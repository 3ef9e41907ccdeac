"""The loss of the head node under load, on a multi-node cluster on this machine: with Ray's GCS
kept in Redis (GCS fault tolerance) and without it (the control).

The head runs no replicas (`--num-cpus=0`): it holds the GCS and Serve's controller. Two worker
nodes, each with its own loopback address (127.0.0.2, 127.0.0.3), each run a router replica
(`router_max_per_node=1`) whose door binds that address (`front_host="node"`), shard replicas, and
an edge (HAProxy, the default admission) on that address in front of its own router, as
configs/cluster.yaml's serving workers do; IndexControl runs beside a router. The load alternates
between the two edges.

Each run: deploy index A, swap to B, an open loop of searches (vegeta, ~60/s, bounded), SIGKILL of
every process of the head node, the same `ray start --head` again after `down_s`, then a swap back
to A through the restarted head. It records, per run:

- `requests`, `answered_200`, `lost` (no HTTP answer at all);
- `recovered_s`: from the restart to every Serve app RUNNING again (None: not within the wait);
- `replicas_restarted`: router and shard replicas whose pid changed;
- `pointer_ok`: the routers still serve B, the version of the last acknowledged swap;
- `swap_after_ok`: the swap back to A after the restart succeeded and is served;
- with the store, `writes`: single upserts and deletes (5/s, their log a stream in the same Redis,
  `SHARDSERVE_WRITE_LOG` on every node) from before the kill to after the restart, each checked by
  a search right after its 200, then all checked again (before the swap back: they are B's);
  `collection_writes`: the same into a collection, and `chroma_adds`: single adds through Chroma's
  API to a Chroma collection, 5/s each (their catalogues and logs in the collections directory, on
  the workers' disk: one disk on this machine), then read back.

Then, with the store only, worker 2 (a router and shards on it) and its edge are SIGKILLed under
the same rate through worker 1's edge (a load balancer's health check takes the lost node's edge
out; `worker_loss`): what was answered, and whether Serve placed its shard replicas on worker 1
again.

    python -m loadtests.head_loss --out loadtests/records/head-loss.json

It needs Debian's redis-server (`make redis`) and vegeta (`make vegeta`). Everything it starts (the
cluster, Redis, vegeta) is stopped by pid before it returns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import httpx

from deployments.run import wait_until_healthy
from index_build.job import build_index
from loadtests.crash_writes import Load, check
from loadtests.during import BackgroundLoad, tally
from loadtests.local_cluster import LocalCluster, RedisStore
from loadtests.record import RECORDS, header
from serving.edge import EdgeProcess
from shardserve.client import Client
from shardserve.data.datasets import load_dataset
from shardserve.runtime import procfs

WORKERS: list[dict[str, float]] = [{"shard_host": 1, "serving": 1}, {"shard_host": 1, "serving": 1}]
FRONT_PORT = 28080  # each router's door, on its node's address
EDGE_PORT = 28090  # each serving node's edge, on its node's address
WRITES_PER_S = 5.0  # single upserts and deletes beside the searches, with the store
COLLECTION = "during-loss"  # a collection and a Chroma collection written through the loss
CHROMA = "/api/v2/tenants/default_tenant/databases/default_database"
SHARDSERVE = str(Path(sys.executable).parent / "shardserve")


def build_pair(work: Path, rows: int = 5000) -> tuple[str, str]:
    """Two small 2-shard indexes of the same Fashion-MNIST rows (a swap needs the same data)."""
    a, b = work / "a", work / "b"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(a), limit=rows, backend="local")
    build_index("fashion-mnist", 2, "IVF32,Flat", str(b), limit=rows, backend="local")
    return str(a), str(b)


def serving_replicas(cluster: LocalCluster, nodes: list[int] | None = None) -> dict[str, int]:
    """Serve replica name (ServeReplica:app:deployment, numbered when repeated) -> pid, on the
    worker nodes (`nodes`: those numbers only, from 1)."""
    found: dict[str, int] = {}
    for number, raylet in enumerate(cluster.worker_raylets, start=1):
        if nodes is not None and number not in nodes:
            continue
        for pid in sorted(procfs.descendants(raylet)):
            command = procfs.cmdline(pid).split(b"\0", 1)[0].decode(errors="replace")
            if command.startswith("ray::ServeReplica:"):
                app, deployment = command.removeprefix("ray::ServeReplica:").split(":", 1)
                # a replica's title names the method it runs, if any: the replica is the same
                name, n = f"ServeReplica:{app}:{deployment.split('.', 1)[0]}", 1
                while (f"{name}#{n}" if n > 1 else name) in found:
                    n += 1
                found[f"{name}#{n}" if n > 1 else name] = pid
    return found


def _settled(cluster: LocalCluster, timeout_s: float = 120.0) -> dict[str, int]:
    """The replicas once a swap's old version is gone (one index app left), or as they are after
    `timeout_s`: a replica of a retired version ending later is not a restart."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = serving_replicas(cluster)
        apps = {name.split(":")[1] for name in replicas}
        if len(apps) <= 2 or time.monotonic() > deadline:  # the router's app and one index version's
            return replicas
        time.sleep(1)


def _served_version(url: str) -> str | None:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        return httpx.get(f"{url}/v1/index", timeout=10).json()["index_version"]
    return None


def _driver(cluster: LocalCluster, code: str, timeout_s: float) -> str:
    """Run `code` in a new driver process connected to the cluster; its output (RuntimeError when
    it fails, TimeoutExpired past `timeout_s`: a driver of a cluster that lost its state hangs)."""
    script = (f"import ray\nray.init(address={cluster.address!r}, log_to_driver=False)\n"
              + textwrap.dedent(code))
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **cluster.driver_env()},
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"driver failed: {done.stderr.strip()[-1500:]}")
    return done.stdout


def _wait_running(cluster: LocalCluster, timeout_s: float) -> float | None:
    """When (time.time()) a new driver sees every Serve app RUNNING again; None when not within
    `timeout_s`."""
    try:
        _driver(cluster, """
            import time
            from ray import serve
            while True:
                try:
                    apps = serve.status().applications
                    if apps and all(a.status == "RUNNING" for a in apps.values()):
                        break
                except Exception:
                    pass
                time.sleep(0.5)
        """, timeout_s)
    except (subprocess.TimeoutExpired, RuntimeError):
        return None
    return time.time()


def _swap(cluster: LocalCluster, index: str, timeout_s: float = 240) -> tuple[bool, str]:
    env = {**os.environ, **cluster.driver_env()}
    try:
        done = subprocess.run([SHARDSERVE, "swap", index, "--address", cluster.address], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"no answer in {timeout_s} s"
    return done.returncode == 0, (done.stdout + done.stderr).strip().splitlines()[-1:][0] if (
        done.stdout + done.stderr).strip() else ""


def one_run(a: str, b: str, with_store: bool, work: Path, rate: float = 60.0, lead_s: float = 10.0,
            down_s: float = 20.0, after_s: float = 60.0, recover_wait_s: float = 120.0,
            kill_worker: bool = True) -> dict:
    data = load_dataset("fashion-mnist", limit=5000, num_queries=200)
    queries, base = data.queries, data.base
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(RedisStore()) if with_store else None
        cluster = stack.enter_context(LocalCluster(
            workers=WORKERS, head_cpus=0, head_resources={}, store=store, own_temp_dirs=True,
            worker_wait_for_head_s=600, node_env=store.write_log_env() if store else None,
            node_ips=True))
        ips = [cluster.node_ip(n) for n in range(1, len(WORKERS) + 1)]
        edges = [stack.enter_context(EdgeProcess(f"{ip}:{FRONT_PORT}", f"{ip}:{EDGE_PORT}")) for ip in ips]
        urls = [f"http://{ip}:{EDGE_PORT}" for ip in ips]
        url = urls[0]
        _driver(cluster, f"""
            from deployments.run import deploy
            deploy({a!r}, serve_http=False, front_port={FRONT_PORT}, front_host="node", router_replicas=2,
                   router_max_per_node=1, router_resources={{"serving": 0.01}},
                   shard_resources={{"shard_host": 0.01}}, shard_num_cpus=0.25, router_num_cpus=0.25,
                   warm_workers=0)
        """, timeout_s=600)  # a driver of its own, gone before the head is
        for each in urls:  # every node's edge reaches its own router
            wait_until_healthy(each)
        swapped_before, swap_note = _swap(cluster, b)
        if not swapped_before:
            raise RuntimeError(f"the swap to B before the head's loss failed: {swap_note}")
        version_b = _served_version(url)
        before = _settled(cluster)
        events: dict[str, float] = {}
        load = BackgroundLoad(urls, queries, rate, lead_s + down_s + after_s, work / "load", {"nprobe": 8})
        # with the store, the write log is a stream in the same Redis: single writes go on throughout
        writes = Load(urls, base.shape[1], base, writes_per_s=WRITES_PER_S, searcher=False) if store else None
        # and a collection's and a Chroma collection's (their catalogue and logs on the workers' disk)
        beside = None
        if store:
            Client(urls, timeout_s=60).create_collection(COLLECTION, base.shape[1])
            beside = (Load(urls, base.shape[1], base, seed=1, writes_per_s=WRITES_PER_S, searcher=False,
                           collection=COLLECTION), ChromaAdds(urls, base, WRITES_PER_S))
        with load:
            for writer in (writes, *(beside or ())):
                if writer is not None:
                    writer.start()
            time.sleep(lead_s)
            events["head_killed"] = time.time()
            killed = cluster.kill_head()
            time.sleep(down_s)
            events["head_restart"] = time.time()
            cluster.restart_head()
            running = _wait_running(cluster, recover_wait_s)
            recovered_s = None if running is None else round(running - events["head_restart"], 1)
            if running is not None:
                events["apps_running"] = running
        hits = load.results()
        written = collection_written = chroma_written = None
        if writes is not None:
            writes.stop()  # then every acknowledged write checked, through the restarted head
            written = _writes_kept(urls, writes)
        if beside is not None:
            for writer in beside:
                writer.stop()
            collection_written = _writes_kept(urls, beside[0], COLLECTION)
            chroma_written = beside[1].kept()
        after = serving_replicas(cluster)
        pointer_ok = version_b is not None and _served_version(url) == version_b
        version_a = None
        swap_after_ok, swap_after_note = _swap(cluster, a)
        if swap_after_ok:
            version_a = _served_version(url)
            swap_after_ok = version_a is not None and version_a != version_b
        result = tally(hits, events)
        lost_worker = (_lose_a_worker(cluster, url, edges[1], queries, rate, work)
                       if with_store and kill_worker else None)
    codes = result["status_codes"]
    return {
        "requests": result["requests"], "answered_200": codes.get("200", 0), "lost": result["lost"],
        "recovered_s": recovered_s,
        "replicas_restarted": sum(1 for name, pid in before.items() if after.get(name) != pid),
        "pointer_ok": pointer_ok, "swap_after_ok": swap_after_ok,
        "answered_ratio": round(codes.get("200", 0) / max(result["requests"], 1), 5),
        "status_codes": codes, "errors": result["errors"],
        "swap_before": {"ok": swapped_before, "said": swap_note},
        "swap_after": {"said": swap_after_note}, "head_processes_killed": len(killed),
        "replicas_before": sorted(before), "replicas_after": sorted(after),
        "events_s": result["events_s"], "timeline": result["timeline"],
        **({} if written is None else {"writes": written}),
        **({} if collection_written is None else {"collection_writes": collection_written,
                                                  "chroma_adds": chroma_written}),
        **({} if lost_worker is None else {"worker_loss": lost_worker}),
    }


def _writes_kept(url: list[str], writes: Load, collection: str | None = None) -> dict:
    """What the writer was told across the head's loss, and what a search finds of it after (in
    `collection` when given)."""
    ledger, checked = writes.ledger, check(url, writes.ledger, collection)
    return {"upserts_acked": len(ledger.upserted), "deletes_acked": len(ledger.deleted),
            "unknown": len(ledger.unknown), "refused": ledger.refused,
            "upserts_lost": len(checked["upserts_lost"]),
            "deletes_returned": len(checked["deletes_returned"]),
            "seen_at_once": sum(x is True for x in ledger.seen_at_once),
            "missed_at_once": sum(x is False for x in ledger.seen_at_once)}


class ChromaAdds:
    """One record at a time added through Chroma's API (`/api/v2`) to a Chroma collection, the
    edges in turn, `per_s` a second until stopped: the ids answered 200, and after, which of them a
    `get` finds."""

    def __init__(self, urls: list[str], base, per_s: float):
        self.urls, self.base, self.pause_s = urls, base, 1.0 / per_s
        self.acked: list[str] = []
        self.failed: dict[str, int] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._add, daemon=True)
        made = httpx.post(f"{urls[0]}{CHROMA}/collections", json={"name": COLLECTION}, timeout=60)
        made.raise_for_status()
        self.route = f"{CHROMA}/collections/{made.json()['id']}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=120)

    def _add(self) -> None:
        clients = [httpx.Client(base_url=url, timeout=30) for url in self.urls]
        n = 0
        while not self.stopping.is_set():
            n += 1
            sid = f"r{n}"
            try:
                answer = clients[n % len(clients)].post(f"{self.route}/add", json={
                    "ids": [sid], "embeddings": [self.base[n % len(self.base)].tolist()],
                    "metadatas": [{"n": n}]})
                if answer.status_code == 200:
                    self.acked.append(sid)
                else:
                    self.failed[str(answer.status_code)] = self.failed.get(str(answer.status_code), 0) + 1
            except httpx.HTTPError as exc:
                self.failed[type(exc).__name__] = self.failed.get(type(exc).__name__, 0) + 1
            self.stopping.wait(self.pause_s)
        for client in clients:
            client.close()

    def kept(self) -> dict:
        found: set[str] = set()
        for start in range(0, len(self.acked), 500):
            answer = httpx.post(f"{self.urls[0]}{self.route}/get", json={"ids": self.acked[start:start + 500],
                                                                        "include": []}, timeout=120)
            answer.raise_for_status()
            found.update(answer.json()["ids"])
        return {"adds_acked": len(self.acked), "adds_lost": len(set(self.acked) - found),
                "not_acked": self.failed}


def _deployment(name: str) -> str:
    """ServeReplica:app:deployment#2 -> deployment (apps of later index versions keep the names)."""
    return name.split("#")[0].rsplit(":", 1)[-1]


def _lose_a_worker(cluster: LocalCluster, url: str, edge: EdgeProcess, queries, rate: float, work: Path,
                   lead_s: float = 8.0, after_s: float = 40.0, replace_wait_s: float = 120.0) -> dict:
    """Under the same rate through worker 1's edge `url`, SIGKILL worker 2 (a router, IndexControl
    or shards on it) and its `edge`: what was answered, and whether Serve placed its shard replicas
    on worker 1 again."""
    _settled(cluster)  # the swap back's old version gone first: its replicas are not this node's load
    on_victim = sorted({_deployment(n) for n in serving_replicas(cluster, [2])})
    events: dict[str, float] = {}
    load = BackgroundLoad(url, queries, rate, lead_s + after_s, work / "load-worker", {"nprobe": 8})
    with load:
        time.sleep(lead_s)
        events["worker_killed"] = time.time()
        cluster.kill_worker(2)
        if edge.process is not None:
            edge.process.kill()  # the node's edge goes with it
    result = tally(load.results(), events)
    wanted = {d for d in on_victim if d.startswith("shard-")}
    deadline = time.monotonic() + replace_wait_s
    while time.monotonic() < deadline:
        if wanted <= {_deployment(n) for n in serving_replicas(cluster, [1])}:
            break
        time.sleep(1)
    survivor = sorted({_deployment(n) for n in serving_replicas(cluster, [1])})
    codes = result["status_codes"]
    return {
        "requests": result["requests"], "answered_200": codes.get("200", 0), "lost": result["lost"],
        "answered_200_after_the_kill": sum(second.get("200", 0) for second in result["timeline"]
                                           if second["second"] > result["events_s"]["worker_killed"] + 1),
        "partial_answers": result["coverage"].get("partial", 0), "status_codes": codes,
        "errors": result["errors"], "deployments_on_killed_worker": on_victim,
        "deployments_on_worker_1_after": survivor, "shards_placed_again": wanted <= set(survivor),
        "events_s": result["events_s"],
    }


def run(work: Path, rate: float = 60.0, lead_s: float = 10.0, down_s: float = 20.0,
        after_s: float = 60.0) -> dict:
    a, b = build_pair(work)
    runs = {name: one_run(a, b, store, work / name, rate, lead_s, down_s, after_s)
            for name, store in (("with_store", True), ("control", False))}
    return {
        **header("head-loss"),
        "cluster": {"head": "--num-cpus=0: GCS and Serve's controller, no replicas",
                    "workers": WORKERS, "router_replicas": 2, "router_max_per_node": 1,
                    "worker_wait_for_head_s": 600,
                    "store": "Debian redis-server on loopback, password, appendonly + appendfsync always"},
        "load": {"rate": rate, "lead_s": lead_s, "down_s": down_s, "after_s": after_s,
                 "through": "each worker node's edge (HAProxy, default admission) on its own address, "
                            "in front of its own router's door; alternating (worker loss: worker 1's)"},
        **runs,
    }


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--out", default=str(RECORDS / "head-loss.json"))
    cli.add_argument("--rate", type=float, default=60.0)
    cli.add_argument("--down-s", type=float, default=20.0)
    cli.add_argument("--after-s", type=float, default=60.0)
    args = cli.parse_args()
    with tempfile.TemporaryDirectory(prefix="head-loss-") as work:
        record = run(Path(work), args.rate, down_s=args.down_s, after_s=args.after_s)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for name in ("with_store", "control"):
        r = record[name]
        print(f"{name}: {r['answered_200']}/{r['requests']} answered 200, {r['lost']} lost, recovered "
              f"in {r['recovered_s']} s, {r['replicas_restarted']} replicas restarted, pointer "
              f"{'ok' if r['pointer_ok'] else 'WRONG'}, swap after "
              f"{'ok' if r['swap_after_ok'] else 'FAILED'}")


if __name__ == "__main__":
    main()
