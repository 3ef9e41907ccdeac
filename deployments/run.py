"""`shardserve serve`: one command from an index directory to a running HTTP endpoint."""

from __future__ import annotations

import os
import time

from shardserve.errors import BadArgument, ShardserveError
from shardserve.index.manifest import Published

APP_NAME = "shardserve"


def deploy(index: str | Published, host: str = "127.0.0.1", port: int = 8000, app_name: str = APP_NAME,
           route_prefix: str = "/", wait: bool = True, shard_class: type | None = None,
           serve_http: bool = True, **overrides) -> str:
    """Deploy the app on the connected Ray (starting Serve if needed); return its base URL.
    `index`: a directory or URI, or the index as its caller already opened it (read once).
    `shard_class` replaces the shard deployment's class (see build_index_app).
    `serve_http=False` (with a `front_port`): Serve starts no HTTP proxy of its own, and the URL is
    the router's door, on `front_host`. For a Serve this process starts in front of an edge that
    reaches the door: Serve's proxy would be two idle processes and a port nothing uses."""
    if not serve_http and overrides.get("front_port") is None:
        raise BadArgument("serve_http=False needs a front_port: the router's door is then its only HTTP")
    from ray import serve

    from deployments.app import router_app
    from deployments.config import AppArgs, index_app_name
    from deployments.control import forget_pointer
    from deployments.index_version import index_app
    from shardserve.runtime.ray_private import run_app

    # Both apps bind to the version published now: a rebuild in place never reaches them.
    published = index if isinstance(index, Published) else Published.open(absolute(index))
    args = AppArgs(index=published.version.uri, **overrides).model_dump()
    if serve_http:
        serve.start(http_options={"host": host, "port": port})
    else:
        serve.start(proxy_location="Disabled")
    forget_pointer(app_name)  # a fresh deployment starts from its configured index
    # The shards first (their own app, no HTTP route), then the router that finds them by name.
    run_app(index_app(args, shard_class, published), index_app_name(app_name), None, blocking=wait)
    run_app(router_app(args, published), app_name, route_prefix if serve_http else None, blocking=wait)
    if not serve_http:
        host, port, route_prefix = args["front_host"], args["front_port"], "/"  # the door: no prefix
    if host == "node":  # a door on each router's node address: Serve said RUNNING, the caller probes
        return f"http://NODE-ADDRESS:{port}"
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}{route_prefix.rstrip('/')}"
    if wait:
        wait_until_healthy(url)
    return url


def undeploy(app_name: str = APP_NAME) -> None:
    """Delete the router app and every index-version app it has served."""
    from ray import serve

    from deployments.config import index_app_name
    from deployments.control import forget_pointer
    from shardserve.runtime.ray_private import delete_app_nowait

    names = [name for name in serve.status().applications
             if name == app_name or name.startswith(index_app_name(app_name))]
    for name in names:  # all at once: each ingress replica takes Serve's drain period to stop
        delete_app_nowait(name)
    forget_pointer(app_name)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and set(names) & set(serve.status().applications):
        time.sleep(0.5)


def router_replicas(app_name: str = APP_NAME) -> int:
    """RUNNING replicas of the app's router, from Serve's status."""
    from ray import serve

    status = serve.status().applications[app_name].deployments["Router"]
    return sum(n for state, n in status.replica_states.items() if state == "RUNNING")


def shard_replicas(app_name: str = APP_NAME) -> dict[str, int]:
    """RUNNING replicas of each shard deployment of the app's index version(s), from Serve's status."""
    from ray import serve

    from deployments.config import INDEX_INGRESS, index_app_name

    counts: dict[str, int] = {}
    for name, app in serve.status().applications.items():
        if not name.startswith(index_app_name(app_name)):
            continue
        for deployment, status in app.deployments.items():
            if deployment != INDEX_INGRESS:
                running = sum(n for state, n in status.replica_states.items() if state == "RUNNING")
                counts[deployment] = counts.get(deployment, 0) + running
    return counts


def wait_until_healthy(url: str, timeout_s: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/v1/health", timeout=5.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.5)
    raise ShardserveError(f"{url} not healthy after {timeout_s:.0f} s ({last})")


def absolute(index: str) -> str:
    """A local path made absolute (replicas run elsewhere); a URI as it is."""
    return index if "://" in index else os.path.abspath(index)
