"""`shardserve serve`: one command from an index directory to a running HTTP endpoint, on a local Ray
it starts (or one it joins), with overload shed at an HAProxy edge by default.

Why the edge: past capacity the router's event loop is the saturated resource, so a 503 decided in
Python waits behind the queue it protects. The edge (serving/edge.py) admits by standing queue: a
client that waits for its answers is queued, never refused; a request that finds the edge's queue
full gets 503 + Retry-After at once, in C. The edge sends requests to the router replicas' own HTTP
door (transport.http_front), not through Serve's HTTP ingress: that path cost more server CPU per request
than the whole monolith baseline spends.
"""

from __future__ import annotations

import signal
import time

from deployments.run import APP_NAME, deploy, undeploy
from serving.edge import Admission, EdgeProcess, haproxy_binary
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location
from shardserve.runtime.ports import free_port


def serve_blocking(index: str, host: str = "127.0.0.1", port: int = 8000, replicas_per_shard: int = 1,
                   num_cpus: float | None = None, edge: bool = True, admission: Admission | None = None,
                   api_key: str | None = None, access_log: str | None = None) -> None:
    """Start (or join) Ray with the fast ingress, deploy, print how to query, serve until Ctrl-C.

    Arguments:
        admission: the edge's in-flight and queue bounds (serving.edge.Admission; default: its defaults).
        api_key: when set, the edge answers 401 to any request but /v1/health without it.
        access_log: a file the edge appends a line per request to (HAProxy's HTTP log format, with
            its timers: time queued at the edge, the router's time, the total).
    """
    from shardserve.runtime.ray_session import ensure_ray, shutdown_ray

    manifest = read_manifest(Location.parse(index))  # bad index: one line, before Ray starts
    started = ensure_ray(num_cpus=num_cpus, serving_node=True, dashboard=True)
    # Stop cleanly on SIGTERM (service managers) and on SIGINT even when started in the background
    # (a non-interactive shell starts background jobs with SIGINT ignored). After ray.init: Ray's
    # own SIGTERM handler in the driver dumps a stack and aborts, leaving the cluster running.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    # A joined cluster's Serve already listens where its owner put it: the edge is ours to add only
    # in front of a Serve this command starts.
    use_edge = edge and started and haproxy_binary() is not None
    front: EdgeProcess | None = None
    try:
        if use_edge:
            front_port = free_port()  # the router's door; Serve runs no HTTP proxy of its own here
            deploy(index, replicas_per_shard=replicas_per_shard, serve_http=False, front_port=front_port)
            a = admission or Admission()
            front = EdgeProcess(f"127.0.0.1:{front_port}", f"{host}:{port}", a, api_key, access_log).start()
            url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
            shedding = (f"edge: {a.max_in_flight} requests in flight, {a.max_burst} queued ({a.max_queue} "
                        f"while shedding, and at most {a.delay_ms} ms of answers inside), beyond that 503 at "
                        f"once (router door 127.0.0.1:{front_port})"
                        + ("; API key required" if api_key else ""))
        else:
            url = deploy(index, host, port, replicas_per_shard=replicas_per_shard)
            shedding = "no edge (" + ("disabled" if not edge else "joined cluster" if not started
                                      else "haproxy not installed") + "): the router sheds"
        print(f"shardserve: serving {manifest.index_factory} index {manifest.index_version} "
              f"({manifest.num_vectors} vectors, {len(manifest.shards)} shards) at {url}")
        print(f"  overload: {shedding}")
        print(f"  docs:   {url}/docs   health: {url}/v1/health   index: {url}/v1/index")
        print("  query:  python3 -c 'import json; print(json.dumps({\"vector\": [0.0]*"
              f"{manifest.dim}, \"k\": 5}}))' | curl -s -H 'content-type: application/json' "
              f"--data-binary @- {url}/v1/search")
        print("  Ctrl-C stops it.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if front is not None:
            front.stop()
        if started:
            # Our own Ray: every app on it is ours, and ending Ray ends them. serve.shutdown() first
            # waited 30 s for the controller to drain what Ctrl-C is meant to stop.
            shutdown_ray()
        else:  # joined someone's cluster: delete only what this command deployed (and its swaps)
            undeploy(APP_NAME)


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt
