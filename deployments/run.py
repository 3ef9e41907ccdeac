"""`shardserve serve`: one command from an index directory to a running HTTP endpoint."""

from __future__ import annotations

import os
import time

from serving.errors import ShardserveError

APP_NAME = "shardserve"


def deploy(index: str, host: str = "127.0.0.1", port: int = 8000, app_name: str = APP_NAME,
           route_prefix: str = "/", **overrides) -> str:
    """Deploy the app on the connected Ray (starting Serve if needed); return its base URL."""
    from ray import serve

    from deployments.app import build_app
    from deployments.config import AppArgs

    args = AppArgs(index=_absolute(index), **overrides)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(args.model_dump()), name=app_name, route_prefix=route_prefix)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}{route_prefix.rstrip('/')}"
    wait_until_healthy(url)
    return url


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


def serve_blocking(index: str, host: str = "127.0.0.1", port: int = 8000,
                   replicas_per_shard: int = 1) -> None:
    """Start (or join) Ray with the fast ingress, deploy, print how to query, serve until Ctrl-C."""
    from ray import serve

    from deployments.app import build_app  # noqa: F401  (import errors before Ray starts)
    from index_build.manifest import read_manifest
    from index_build.storage import Location
    from serving.ray_local import ensure_ray, shutdown_ray

    manifest = read_manifest(Location.parse(index))  # bad index: one line, before Ray starts
    started = ensure_ray(fast_ingress=True, dashboard=True)
    try:
        url = deploy(index, host, port, replicas_per_shard=replicas_per_shard)
        print(f"shardserve: serving {manifest.index_factory} index {manifest.index_version} "
              f"({manifest.num_vectors} vectors, {len(manifest.shards)} shards) at {url}")
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
        serve.shutdown()
        if started:
            shutdown_ray()


def _absolute(index: str) -> str:
    return index if "://" in index else os.path.abspath(index)
