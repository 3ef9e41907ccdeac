"""Every Ray API shardserve uses that is not public, in one place, each with why it is needed.

Checked against Ray 2.60 (pinned in pyproject.toml). Importing this module under another Ray
version warns once: read these functions against that version's source before trusting them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import ray

from shardserve.errors import ServingError

CHECKED_RAY = "2.60."
if not ray.__version__.startswith(CHECKED_RAY):
    warnings.warn(f"shardserve's private Ray calls (runtime/ray_private.py) were checked against Ray "
                  f"{CHECKED_RAY}x, this is {ray.__version__}", RuntimeWarning, stacklevel=2)

KV_NAMESPACE = "shardserve"


def run_app(app, name: str, route_prefix: str | None, blocking: bool) -> None:
    """`serve._run`: serve.run's own implementation. Its `_blocking=False` lets a caller deploy an
    app and watch it come up (health during start-up, a swap's new version beside the old one);
    `serve.run` always blocks until the app is RUNNING."""
    from ray import serve

    serve._run(app, name=name, route_prefix=route_prefix, _blocking=blocking)


def delete_app_nowait(name: str) -> None:
    """`serve.delete(_blocking=False)`: start deleting and return. Deleting several apps at once
    then takes one drain period (an ingress replica lingers ~30 s), not one per app."""
    from ray import serve

    serve.delete(name, _blocking=False)


def deployment_handle_unchecked(deployment: str, app: str):
    """`get_deployment_handle(_check_exists=False)`: a router replica makes handles to another
    app's deployments inside its own constructor; the public call asks the controller whether the
    app exists, which fails while that app is still being deployed (and costs a round trip)."""
    from ray import serve

    return serve.get_deployment_handle(deployment, app, _check_exists=False)


def local_cluster_running() -> bool:
    """`ray._private.services.find_gcs_addresses`: is a Ray started by `ray start` on this machine?
    (`ray.init(address="auto")` would join it, and fail with a stack trace when there is none.)"""
    try:
        from ray._private.services import find_gcs_addresses

        return bool(find_gcs_addresses())
    except Exception:
        return False


def local_gcs_addresses() -> list[str]:
    """The GCS addresses of every Ray running on this machine (the same private call)."""
    try:
        from ray._private.services import find_gcs_addresses

        return sorted(find_gcs_addresses())
    except Exception:
        return []


def own_raylet_running() -> bool:
    """`ray._private.worker._global_node`: did this process start the Ray it is connected to (and
    so must stop that Ray's HAProxy after it)? A driver that joined a cluster has no raylet of its
    own in `all_processes`."""
    node = ray._private.worker._global_node
    return node is not None and bool(node.all_processes.get("raylet"))


def kv_get(key: str) -> bytes | None:
    """`ray.experimental.internal_kv`: the GCS key-value store Serve keeps its own checkpoints in.
    State put here outlives any actor or replica (not the GCS itself, unless GCS fault tolerance
    is configured), which is what a pointer that must survive its replica's restart needs."""
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=KV_NAMESPACE)


def kv_put(key: str, value: bytes) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)


def kv_delete(key: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=KV_NAMESPACE)


def kv_list(prefix: str) -> list[str]:
    """Keys under `prefix` in shardserve's namespace of the GCS key-value store."""
    from ray.experimental.internal_kv import _internal_kv_list

    return [k.decode() if isinstance(k, bytes) else k
            for k in _internal_kv_list(prefix, namespace=KV_NAMESPACE)]


def prestart_workers(count: int, keep_alive_s: int) -> None:
    """The raylet's `PrestartWorkers` RPC (what Ray core itself sends when tasks queue up), to this
    process's own node: start `count` idle Python workers and keep them alive `keep_alive_s`, so the
    next actor placed here (a new Serve replica) takes one instead of spawning a process and
    importing everything (shardserve.runtime.warm_pool says why). No public API starts idle workers on demand.
    Needs the cluster's auth token in the call's metadata when token auth is on."""
    import grpc
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

    node = ray._private.worker.global_worker.node
    assert node is not None, "prestart_workers runs in a Ray worker (a replica), where Ray is initialised"
    request = node_manager_pb2.PrestartWorkersRequest(  # type: ignore[attr-defined]
        language=common_pb2.PYTHON, num_workers=count, keep_alive_duration_secs=keep_alive_s)  # type: ignore[attr-defined]
    request.runtime_env_info.serialized_runtime_env = "{}"  # matches replicas with no runtime_env
    token = AuthenticationTokenLoader.instance().get_token_for_http_header(ignore_auth_mode=True)
    with grpc.insecure_channel(f"{node.node_ip_address}:{node.node_manager_port}") as channel:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
            request, timeout=10, metadata=tuple(token.items()))


def cores() -> int:
    """The CPUs Ray counts on this machine by default (cgroup quotas and cpusets included, which
    os.cpu_count() ignores: a 2-CPU container on a 64-core host is 2)."""
    from ray._private.utils import get_num_cpus

    return int(get_num_cpus())


def dashboard() -> tuple[str | None, bool]:
    """(the dashboard's address on the connected cluster or None, whether it wants Ray's auth token):
    what `serve`'s banner tells a user, who otherwise meets an "Authentication Token Required" page
    with nothing saying which token. `ray.init` returns the address, but `ensure_ray` may have joined
    a cluster; no public API reports either afterwards."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    try:
        url = ray._private.worker.get_dashboard_url()
    except Exception:  # not connected, or no dashboard
        url = None
    return (f"http://{url}" if url and "://" not in url else url or None), is_token_auth_enabled()


def session_dir() -> Path:
    """The connected Ray's session directory on this node (where its dashboard writes the
    Prometheus configuration of the session, `metrics/prometheus/prometheus.yml`)."""
    node = ray._private.worker._global_node
    if node is None:
        raise ServingError("not connected to Ray: no session directory")
    return Path(node.get_session_dir_path())
