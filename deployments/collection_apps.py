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
import time
from pathlib import Path

from shardserve.errors import ShardserveError
from shardserve.index.manifest import Published

APART = "served-apart"  # in a collection's directory: the name of the application serving it apart
PREFIX = "collection-"
# Their replicas' reservations: logical, so that a server holds several beside its own index and
# the versions a swap runs side by side; the cores are shared as the other replicas share them.
APART_NUM_CPUS = 0.05
# The operator's bounds (app arguments `min_apart_at`, `max_collections_apart`): a collection's
# spec asks for `apart_at`, but never below the server's floor, and only so many go apart; the
# others stay in the router replicas. A deploy or swap not running within APART_TIMEOUT_S is undone.
MIN_APART_AT = 100_000
MAX_COLLECTIONS_APART = 8
APART_TIMEOUT_S = 180.0


def collection_of(app: str) -> int | None:
    """The collection id of an application of a collection (`collection-<id>`, its index apps
    `collection-<id>-index…`), or None."""
    if not app.startswith(PREFIX):
        return None
    number = app[len(PREFIX):].split("-", 1)[0]
    return int(number) if number.isdigit() else None


def app_of(collection_id: int) -> str:
    return f"{PREFIX}{collection_id}"


def apart_app(path: Path) -> str | None:
    """The application serving the collection at `path` apart, if the folder deployed one."""
    try:
        return (path / APART).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def deploy_apart(collection_id: int, path: Path, overrides: dict, timeout_s: float = APART_TIMEOUT_S) -> str:
    """Deploy the collection at `path` as its own router and shards, wait until both run (or undo
    them and raise after `timeout_s`), then name the application in its directory; its name. The
    name is removed first: while it deploys, router replicas answer the collection themselves."""
    from deployments.app import router_app
    from deployments.config import AppArgs, index_app_name
    from deployments.control import forget_pointer
    from deployments.index_version import index_app
    from shardserve.runtime.ray_private import run_app

    app = app_of(collection_id)
    (path / APART).unlink(missing_ok=True)
    published = Published.open(str(path))
    settings = {key: value for key, value in overrides.items() if key in AppArgs.model_fields}
    settings.update(index=published.version.uri, router_num_cpus=APART_NUM_CPUS,
                    shard_num_cpus=APART_NUM_CPUS, router_replicas=1, router_autoscaling=None,
                    front_port=None, warm_workers=0, collections_dir=str(path / "unused-collections"))
    args = AppArgs(**settings).model_dump()
    forget_pointer(app)
    index = index_app_name(app)
    run_app(index_app(args, None, published), index, None, blocking=False)
    run_app(router_app(args, published), app, None, blocking=False)
    _wait_running({index, app}, timeout_s)
    written = path / f".{APART}.tmp"
    written.write_text(app)
    os.replace(written, path / APART)
    return app


def _wait_running(apps: set[str], timeout_s: float) -> None:
    """Until every one of `apps` is RUNNING; past `timeout_s` (or one failed), delete them and raise."""
    from ray import serve

    from shardserve.runtime.ray_private import delete_app_nowait

    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications
        states = {name: getattr(status.get(name), "status", None) for name in apps}
        if all(state == "RUNNING" for state in states.values()):
            return
        if time.monotonic() > deadline or any(state == "DEPLOY_FAILED" for state in states.values()):
            for name in apps:
                delete_app_nowait(name)
            raise ShardserveError(f"{sorted(apps)} not running after {timeout_s:.0f} s ({states}): deleted; "
                                  "the router replicas keep serving the collection")
        time.sleep(0.5)


def running_apps() -> set[str]:
    """The collections' applications (and their index apps) Serve runs now."""
    from ray import serve

    return {name for name in serve.status().applications if name.startswith(PREFIX)}


