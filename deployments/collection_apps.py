"""A large collection served apart: shard deployments of its own, with replicas and autoscaling, as
the index `shardserve serve DIR` serves.

A collection lives in the router replicas while it is small (deployments.collections). Once it is
built (index_build.grow) and holds its spec's `apart_at` points or more, the server's folder
(serving.compactor.CollectionsFolder) deploys its directory, which is an index directory like any,
as two Serve applications, `collection-<id>` (a router, no HTTP route of its own) and its index app
(its shards), exactly as `shardserve serve` deploys an index; then it writes `served-apart` in the
directory. From then on the router replicas forward each of its requests (search, writes, the point
API) to that application's router, which answers them from the same directory and the same write
log: nothing moves, so nothing can be lost in the move, and a write acknowledged by either path is
in the log the other follows. Each later fold of it is swapped in (deployments.swap, no gate: the
fold's own build was gated, and a compaction answers what the log says).

If the application is not there (the server restarted, Ray's state gone), a router answers the
collection itself, as before, until the folder has deployed it again. A dropped collection's
applications are deleted by the folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardserve.index.manifest import Published

APART = "served-apart"  # in a collection's directory: the name of the application serving it apart
PREFIX = "collection-"
# Their replicas' reservations: logical, so that a server holds several beside its own index and
# the versions a swap runs side by side; the cores are shared as the other replicas share them.
APART_NUM_CPUS = 0.05


def app_of(collection_id: int) -> str:
    return f"{PREFIX}{collection_id}"


def apart_app(path: Path) -> str | None:
    """The application serving the collection at `path` apart, if the folder deployed one."""
    try:
        return (path / APART).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def deploy_apart(collection_id: int, path: Path, overrides: dict) -> str:
    """Deploy the collection at `path` as its own router and shards (blocking until they run), then
    name the application in its directory; the application's name."""
    from deployments.app import router_app
    from deployments.config import AppArgs, index_app_name
    from deployments.control import forget_pointer
    from deployments.index_version import index_app
    from shardserve.runtime.ray_private import run_app

    app = app_of(collection_id)
    published = Published.open(str(path))
    settings = {key: value for key, value in overrides.items() if key in AppArgs.model_fields}
    settings.update(index=published.version.uri, router_num_cpus=APART_NUM_CPUS,
                    shard_num_cpus=APART_NUM_CPUS, router_replicas=1, router_autoscaling=None,
                    front_port=None, warm_workers=0, collections_dir=str(path / "unused-collections"))
    args = AppArgs(**settings).model_dump()
    forget_pointer(app)
    run_app(index_app(args, None, published), index_app_name(app), None, blocking=True)
    run_app(router_app(args, published), app, None, blocking=True)
    written = path / f".{APART}.tmp"
    written.write_text(app)
    os.replace(written, path / APART)
    return app


def running_apps() -> set[str]:
    """The collections' applications (and their index apps) Serve runs now."""
    from ray import serve

    return {name for name in serve.status().applications if name.startswith(PREFIX)}


def delete_apart(app: str, running: set[str]) -> None:
    """Start deleting `app` and every index app of it."""
    from deployments.config import index_app_name
    from shardserve.runtime.ray_private import delete_app_nowait

    for name in running:
        if name == app or name.startswith(index_app_name(app)):
            delete_app_nowait(name)
