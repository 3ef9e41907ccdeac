"""`shardserve serve`: one command from an index directory to a running HTTP endpoint, on a local Ray
it starts (or one it joins), with overload shed at an HAProxy edge by default.

Why the edge: past capacity the router's event loop is the saturated resource, so a 503 decided in
Python waits behind the queue it protects. The edge (serving/edge.py) admits by standing queue: a
client that waits for its answers is queued, never refused; a request that finds the edge's queue
full gets 503 + Retry-After at once, in C. The edge sends requests to the router replicas' own HTTP
door (transport.http_front), not through Serve's HTTP ingress: that path costs about as much server CPU
per request as the whole monolith baseline (docs/experiments.md).
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import socket
import time

from deployments.config import EMBEDDER_MAX_REPLICAS, AppArgs
from deployments.run import APP_NAME, absolute, deploy, undeploy
from serving.compactor import COLLECTION_COMPACT_AT, COMPACT_AT, AutoCompactor, CollectionsFolder
from serving.edge import Admission, EdgeProcess, haproxy_binary
from serving.prometheus import HOST as PROMETHEUS_HOST
from serving.prometheus import PrometheusProcess, prometheus_binary
from shardserve import settings
from shardserve.errors import ShardserveError
from shardserve.index.manifest import Published
from shardserve.runtime.ports import free_port
from shardserve.runtime.ray_private import cores, dashboard, session_dir

# Every process this command starts (Ray's, its workers, the edge) inherits this variable with a
# value of the command's own: what a stop finds and ends when an interrupt came before Ray or the
# edge could tell us their pids (inside ray.init, inside Popen).
SERVE_MARK = settings.SERVE_MARK_ENV
_stopping = False


def serve_blocking(index: str | Published, host: str = "127.0.0.1", port: int = 8000,
                   replicas_per_shard: int = 1, num_cpus: float | None = None, edge: bool = True,
                   admission: Admission | None = None, api_key: str | None = None,
                   access_log: str | None = None, address: str | None = None,
                   compact_at: int | None = COMPACT_AT,
                   app_args: dict | None = None, prometheus_port: int | None = None) -> None:
    """Start Ray (or join the one at `address` / RAY_ADDRESS) with the fast ingress, deploy, print
    how to query, serve until Ctrl-C or SIGTERM.

    Arguments:
        admission: the edge's in-flight and queue bounds (serving.edge.Admission; default: its defaults).
        api_key: when set, the edge answers 401 to any request but /v1/health without it. It never
            enters Ray's environment: the caller removes SHARDSERVE_API_KEY before this starts Ray.
        access_log: a file the edge appends a line per request to (HAProxy's HTTP log format, with
            its timers: time queued at the edge, the router's time, the total).
        compact_at: once this many write operations wait past the newest index version, compact
            and swap to it (serving.compactor; None: its default); 0: only by hand. Only on a Ray
            this command starts.
        app_args: application settings (deployments.config.AppArgs fields), as `--arg KEY=JSON`.
        prometheus_port: run Debian's Prometheus on 127.0.0.1 at this port with the scrape
            configuration of the Ray this command starts (serving.prometheus), and point Ray's
            dashboard at it. Only with a Ray this command starts.
        address: a Ray cluster to join. Without it (and without RAY_ADDRESS) this command starts a
            Ray of its own even when another runs on this machine: a second `serve` runs beside
            the first, never inside it (ensure_ray).

    A stop (Ctrl-C, SIGTERM) at any moment, start-up included, ends everything this command
    started: the edge, and the Ray it started with every process of it, before it returns.
    """
    from shardserve.runtime.ray_session import ensure_ray

    # read once, here (or by the caller); a bad index: one line, before Ray starts
    published = index if isinstance(index, Published) else Published.open(absolute(index))
    manifest = published.manifest
    joining = bool(address or os.environ.get("RAY_ADDRESS"))
    if not joining:
        _check_port_free(host, port)  # a port in use: one line now, not after a minute of start-up
    if prometheus_port is not None:
        if joining:
            raise ShardserveError("--prometheus-port runs Prometheus for the Ray this command starts: on a "
                                  "cluster, run it on the head (docs/operations.md, \"Metrics\")")
        if prometheus_binary() is None:
            raise ShardserveError("--prometheus-port: prometheus not found (Debian package `prometheus`; "
                                  "`make prometheus`)")
        _check_port_free(PROMETHEUS_HOST, prometheus_port)
        os.environ["RAY_PROMETHEUS_HOST"] = f"http://{PROMETHEUS_HOST}:{prometheus_port}"  # the dashboard's
    global _stopping
    _stopping = False
    mark = f"{os.getpid()}-{secrets.token_hex(8)}"
    settings.set_serve_mark(mark)
    # Stop cleanly on SIGTERM (service managers) and on SIGINT even when started in the background
    # (a non-interactive shell starts background jobs with SIGINT ignored): from here on, so that a
    # stop during start-up runs the `finally` below too.
    _on_stop_raise()
    front: EdgeProcess | None = None
    metrics: PrometheusProcess | None = None
    compactor: AutoCompactor | None = None
    folder: CollectionsFolder | None = None
    compact_at = COMPACT_AT if compact_at is None else compact_at
    if num_cpus is None and not joining:
        num_cpus = room_for_two_versions(len(manifest.shards), replicas_per_shard,
                                         manifest.embedder is not None)
    try:
        started = ensure_ray(num_cpus=num_cpus, serving_node=True, dashboard=True, address=address,
                             join_local=False)
        _on_stop_raise()  # again: ray.init sets its own SIGTERM handler (stack dump, cluster left up)
        if prometheus_port is not None:  # held before it starts: a stop inside start() still finds it
            metrics = PrometheusProcess(session_dir(), prometheus_port)
            metrics.start()
        # A joined cluster's Serve already listens where its owner put it: the edge is ours to add
        # only in front of a Serve this command starts.
        use_edge = edge and started and haproxy_binary() is not None
        if use_edge:
            front_port = free_port()  # the router's door; Serve runs no HTTP proxy of its own here
            deploy(published, replicas_per_shard=replicas_per_shard, serve_http=False, front_port=front_port,
                   **(app_args or {}))
            a = admission or Admission()
            # held before it starts: a stop inside start() still finds it (and start() ends its
            # HAProxy itself when interrupted)
            front = EdgeProcess(f"127.0.0.1:{front_port}", f"{host}:{port}", a, api_key, access_log)
            front.start()
            url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
            shedding = (f"edge: {a.max_in_flight} requests in flight, {a.max_burst} queued"
                        + (f" or the router's {a.burst_ms} ms of answers" if a.burst_ms else "")
                        + f" ({a.max_queue} "
                        f"while shedding, and at most {a.delay_ms} ms of answers inside), beyond that 503 at "
                        f"once (router door 127.0.0.1:{front_port})"
                        + ("; API key required" if api_key else ""))
        else:
            url = deploy(published, host, port, replicas_per_shard=replicas_per_shard, **(app_args or {}))
            shedding = "no edge (" + ("disabled" if not edge else "joined cluster" if not started
                                      else "haproxy not installed") + "): the router sheds"
        if started and compact_at:  # from the first write the server takes, not after the warm-up:
            # writes arrive as soon as it answers, and a minute of them can fill the backlog bound
            compactor = AutoCompactor(published.location, APP_NAME, compact_at).start()
            folder = _collections_folder(published, app_args or {})
        if started:  # start-up ends with the node's pool of warm workers filled: nothing fills under load
            _wait_for_warm_pool()
        print(f"shardserve: serving {manifest.index_factory} index {manifest.index_version} "
              f"({manifest.num_vectors} vectors, {len(manifest.shards)} shards) at {url}")
        print(f"  overload: {shedding}")
        print(f"  docs:   {url}/docs   health: {url}/v1/health   index: {url}/v1/index")
        print("  query:  python3 -c 'import json; print(json.dumps({\"vector\": [0.0]*"
              f"{manifest.dim}, \"k\": 5}}))' | curl -s -H 'content-type: application/json' "
              f"--data-binary @- {url}/v1/search")
        print(f"  ray:    {_ray_line(started)}")
        print(f"  dashboard: {_dashboard_line()}")
        print(f"  metrics: {_metrics_line(metrics)}")
        print(f"  traces: {_trace_line(app_args or {})}")
        if compactor is not None and compactor.path is not None:
            print(f"  writes: compacted into a new version once {compact_at} wait (--compact-at)")
        if folder is not None:
            print(f"  collections: in {folder.root}, folded once {folder.at_ops} writes wait, built as their "
                  "index past their grow_at")
        print("  Ctrl-C stops it.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if compactor is not None:
            compactor.stop()
        if folder is not None:
            folder.stop()
        _stop(front, joining, mark, metrics)


def _collections_folder(published: Published, app_args: dict) -> CollectionsFolder | None:
    """The folds of the collections this server holds (serving.compactor.CollectionsFolder), on a
    local disk; started with the index's own compactor (the same switch: --compact-at 0 stops both)."""
    from deployments.collections import default_root

    root = app_args.get("collections_dir") or default_root(published.location.uri)
    at_ops = int(app_args.get("collection_compact_at", COLLECTION_COMPACT_AT))
    return None if root is None else CollectionsFolder(str(root), at_ops, app_args=app_args).start()


def room_for_two_versions(shards: int, replicas_per_shard: int, embedder: bool = False) -> int:
    """Logical CPUs for the Ray `serve` starts: its cores, or, if more, room for the router and two
    index versions' shard replicas (and, for an index built from text, their embedders at their
    most replicas) at their default reservations. A swap (by hand or by automatic compaction) runs
    the new version beside the old until the switch; with only the cores counted, four shards on
    two cores have no room for the second. Fixed replicas: the count only places them, it starts
    nothing."""
    defaults = AppArgs.model_fields
    embedders = EMBEDDER_MAX_REPLICAS * defaults["embedder_num_cpus"].default if embedder else 0.0
    need = (2 * (shards * replicas_per_shard * defaults["shard_num_cpus"].default + embedders)
            + defaults["router_num_cpus"].default)
    return max(cores(), math.ceil(need))


def _wait_for_warm_pool(timeout_s: float = 60.0) -> None:
    """Until the Ray this command started holds its warm workers (runtime.warm_pool): each imports
    the serving stack at a priority above the replicas', which would stall them under load."""
    from shardserve.runtime.warm_pool import raylet_of, wait_filled

    target = AppArgs.model_fields["warm_workers"].default
    raylet = raylet_of(os.getpid())
    if target and raylet is not None and not wait_filled(raylet, target, timeout_s):
        print(f"shardserve: the warm worker pool is not full after {timeout_s:.0f} s: it fills "
              "while the node has a core idle", flush=True)


def _stop(front: EdgeProcess | None, joining: bool, mark: str,
          metrics: PrometheusProcess | None = None) -> None:
    """End what this command started, in order: the edge first (no new requests reach a router
    being torn down), then our Ray (or, on a joined cluster, only our apps), then any process still
    carrying this command's mark (what an interrupt inside ray.init or Popen left unnamed)."""
    global _stopping
    _stopping = True  # a second Ctrl-C while stopping is ignored: it would cut the clean-up short
    _on_stop_raise()  # ours again, if a stop inside ray.init left Ray's SIGTERM handler in place
    import ray

    from shardserve.runtime import procfs
    from shardserve.runtime.ray_session import shutdown_ray

    try:
        if front is not None:
            front.stop()
        if metrics is not None:
            metrics.stop()
        if not joining:
            # Our own Ray: every app on it is ours, and ending Ray ends them. serve.shutdown() first
            # would wait for the controller to drain (an ingress lingers 30 s) what Ctrl-C is meant
            # to stop.
            shutdown_ray()
        elif ray.is_initialized():  # joined someone's cluster: delete only what we deployed (and swaps)
            undeploy(APP_NAME)
    finally:
        # (Python's multiprocessing helpers ignore SIGTERM and end with this process)
        left = [pid for pid in procfs.pids_with_environment(SERVE_MARK, mark)
                if b"from multiprocessing." not in procfs.cmdline(pid)]
        procfs.stop(left, grace_s=2.0)


def _on_stop_raise() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum: int, frame) -> None:
    if not _stopping:
        raise KeyboardInterrupt


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port something listens on (another server's edge). SO_REUSEADDR: a port whose last
    connections wait in TIME_WAIT is free to listen on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ShardserveError(f"{host}:{port} is in use ({exc.strerror}): pick another --port") from None


def _dashboard_line() -> str:
    url, token = dashboard()
    if url is None:
        return "none on this cluster"
    return url + (" (it asks for Ray's token: `ray get-auth-token` prints it)" if token else "")


def _metrics_line(metrics: PrometheusProcess | None) -> str:
    if metrics is None:
        return "Prometheus off (--prometheus-port 9090 runs it on this Ray's scrape configuration)"
    return (f"Prometheus at {metrics.url} (e.g. {metrics.url}/graph?g0.expr="
            "rate(ray_shardserve_request_latency_ms_count[1m]); the dashboard queries it too)")


def _trace_line(app_args: dict) -> str:
    """Where this command's replicas send spans (the nodes' SHARDSERVE_TRACE_* unless overridden)."""
    config = AppArgs(index="-", **app_args).trace_config("shardserve")
    if config.endpoint is None:
        return "off (--trace-endpoint URL: OTLP/HTTP, e.g. Jaeger's http://127.0.0.1:4318/v1/traces)"
    return (f"OTLP to {config.endpoint}: every request whose traceparent says sampled, and "
            f"{config.ratio:.2%} of the others (--trace-ratio)")


def _ray_line(started: bool) -> str:
    import ray

    context = ray.get_runtime_context()
    if not started:
        return f"joined the cluster at {context.gcs_address} (Ctrl-C deletes only this command's apps)"
    return (f"its own, at {context.gcs_address} (for `shardserve swap --address`; "
            "another `shardserve serve` starts its own)")
