"""Automatic compaction in `shardserve serve`: once enough writes wait in the log past the newest
version, fold them into a new version (`shardserve compact`) and move the server onto it
(`shardserve swap`, recall-gated, no request refused).

Why here and why a count of operations: every upsert past the served version sits in a shard
replica's delta (memory, bounded: past `max_write_backlog` the router answers 503) and every
delete or overwrite in its tombstones (a selector every base search checks), so what a compaction
buys back grows with the operations waiting, whatever their kind. The default threshold (a quarter
of the backlog bound) leaves three quarters of the bound for the writes that arrive while the
compaction and its swap run, so a steady ingest never meets the 503. The `serve` command owns its
Ray and the index directory: it is where the one writer of new versions runs, as `shardserve
compact` would by hand. On a cluster (`shardserve deploy`), compaction stays on demand.

A failure (a recall gate that refuses, an index kind compaction cannot rewrite) is printed in one
line and tried again only after `retry_s` (a version compacted and published whose swap failed is
swapped again, not compacted again): serving goes on with the delta as it is, and the backlog's
503s still protect memory. After each swap the versions older than the one it replaced are
deleted and the log truncated below what the two kept include, so disk stays bounded however
long writes go on.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable

from deployments.config import AppArgs
from shardserve.errors import BadArgument
from shardserve.index.manifest import Manifest, read_manifest
from shardserve.index.storage import Location
from shardserve.writes.delta import MAX_DELTA_ROWS
from shardserve.writes.locate import log_address, log_exists, open_log
from shardserve.writes.redis_log import LogUnavailable

COMPACT_AT = MAX_DELTA_ROWS // 4  # operations waiting past the newest version (`serve --compact-at`)


class AutoCompactor:
    """A daemon thread: every `poll_s`, compact `index` and swap `app` onto it once `at_ops`
    operations wait past the newest version's log position. `start()`, `stop()`."""

    def __init__(self, index: str | Location, app: str, at_ops: int = COMPACT_AT, poll_s: float = 5.0,
                 retry_s: float = 600.0, say: Callable[[str], None] | None = None):
        if at_ops < 1:
            raise BadArgument("at_ops must be >= 1")
        location = Location.of(index)
        self.index, self.app, self.at_ops = location.uri, app, at_ops
        self.poll_s, self.retry_s = poll_s, retry_s
        # flushed at once: the server's output is often a file, where a buffered line would wait
        self.say = say or (lambda line: print(line, flush=True))
        self.path = log_address(location)
        self.compactions = 0
        self._unswapped: Manifest | None = None  # compacted and published, its swap not yet done
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shardserve-compactor", daemon=True)

    def start(self) -> AutoCompactor:
        if self.path is not None:  # an index on remote storage takes no writes: nothing to compact
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def waiting(self) -> int:
        """Operations in the log past the newest published version (0: no log yet)."""
        if not log_exists(self.path):
            return 0
        assert self.path is not None
        position = read_manifest(Location.parse(self.index)).log_position
        log = open_log(self.path, readonly=True)
        try:
            return log.backlog(position).operations
        finally:
            log.close()

    def run_once(self) -> bool:
        """Compact and swap if the threshold is passed (or swap again, when the last compaction
        was published but its swap failed); True when a new version is served."""
        from deployments.swap import swap_index
        from index_build.compact import compact, prune_versions

        if self._unswapped is None:
            waiting = self.waiting()
            if waiting < self.at_ops:
                return False
            self.say(f"shardserve: {waiting} writes wait past the newest version (--compact-at "
                     f"{self.at_ops}): compacting")
            self._unswapped = compact(self.index)  # published: `waiting` counts from it from now on
            if self._stop.is_set():
                return False  # the server is stopping: the next start serves the new version
        manifest = self._unswapped
        report = swap_index(self.index, self.app)
        self._unswapped = None
        self.compactions += 1
        # Disk stays bounded: the served version and the one before it (`swap --rollback`) are kept,
        # older ones go, and the log below what both include with them.
        gone = prune_versions(self.index, {report["new_version"], report["old_version"]})
        self.say(f"shardserve: compacted and swapped to {report['new_version']} (log position "
                 f"{manifest.log_position}, {manifest.num_vectors} vectors, recall@{report['k']} "
                 f"{report['recall']}, {report['seconds']}; {len(gone)} older version(s) deleted)")
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 (any failure: said, retried later; serving goes on)
                if self._stop.is_set():
                    return  # the server is stopping: what failed is its teardown
                # the log unreachable (its Redis restarting) is tried again at the next poll
                wait = self.poll_s if isinstance(exc, LogUnavailable) else self.retry_s
                self.say(f"shardserve: automatic compaction failed, next try in {wait:.0f} s: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
                self._stop.wait(wait)


# a collection's operations waiting past its newest version (every router replica holds them in
# memory: a small bound, since a server holds many collections); the app argument sets it
COLLECTION_COMPACT_AT = AppArgs.model_fields["collection_compact_at"].default


class CollectionsFolder:
    """A daemon thread in `serve`: every `poll_s`, each live collection under `root` whose log holds
    `at_ops` operations past its newest version, or, while it is exact, enough upserts to reach its
    `grow_at`, is folded (index_build.grow.fold: compacted, or grown into its spec's index behind the
    recall gate). Router replicas see the new version at their next request to it (its manifest
    replaced) and move to it: no process starts, no application is deployed. A fold that fails (a
    gate refusing) is said in one line and that collection tried again after `retry_s`; the others
    go on. After a fold, versions older than the one it replaced go, and the log below them."""

    def __init__(self, root: str, at_ops: int = COLLECTION_COMPACT_AT, poll_s: float = 5.0,
                 retry_s: float = 60.0, backend: str = "ray", say: Callable[[str], None] | None = None,
                 app_args: dict | None = None):
        if at_ops < 1:
            raise BadArgument("at_ops must be >= 1")
        self.root, self.at_ops, self.backend = root, at_ops, backend
        self.poll_s, self.retry_s = poll_s, retry_s
        self.say = say or (lambda line: print(line, flush=True))
        # None: no Serve here (a test's), nothing served apart; else the app settings `serve` uses
        self.app_args = app_args
        self.folds = 0
        self._failed_until: dict[int, float] = {}
        self._refused: dict[str, int] = {}  # live rows a collection's growth was refused at
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shardserve-collections", daemon=True)

    def start(self) -> CollectionsFolder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def due(self, path: str, grow_at: int) -> bool:
        """Whether the collection at `path` should fold now."""
        from index_build.grow import grown

        manifest = read_manifest(Location.parse(path))
        address = log_address(path)
        if address is None or not log_exists(address):
            return False
        log = open_log(address, readonly=True)
        try:
            backlog = log.backlog(manifest.log_position)
        finally:
            log.close()
        # upserts, not every operation, bring it nearer its threshold; once a growth was refused,
        # the next try waits for twice the rows it was refused at
        threshold = max(grow_at, 2 * self._refused.get(path, 0))
        return backlog.operations >= self.at_ops or (backlog.upserts > 0 and not grown(manifest)
                                                     and manifest.num_vectors + backlog.upserts >= threshold)

    def run_once(self) -> int:
        """Fold every collection due; how many were."""
        from pathlib import Path

        from index_build.compact import prune_versions
        from index_build.grow import fold
        from shardserve.collection.catalogue import CATALOGUE, Catalogue

        if not (Path(self.root) / CATALOGUE).exists():
            return 0
        catalogue = Catalogue(self.root, readonly=True)
        try:
            entries = catalogue.live()
        finally:
            catalogue.close()
        folded = 0
        running = self._apart_apps(entries)
        for entry in entries:
            if self._stop.is_set():
                break
            path = str(entry.path)
            if time.monotonic() < self._failed_until.get(entry.id, 0.0):
                continue
            try:
                if not self.due(path, entry.spec.grow_at):
                    self._serve_apart(entry, None, running)  # e.g. deployed again after a restart
                    continue
                before = read_manifest(Location.parse(path)).index_version

                def refused(rows: int, exc: Exception, path: str = path, name: str = entry.name) -> None:
                    self._refused[path] = rows
                    self.say(f"shardserve: collection {name!r} not grown at {rows} points, compacted "
                             f"exact instead (tried again at {2 * rows}): {str(exc).splitlines()[0]}")

                manifest = fold(path, entry.spec, self.backend, refused=refused)
                if manifest is None:
                    self._serve_apart(entry, None, running)
                    continue
                if self._dropped(entry):  # dropped while it folded: what the fold wrote goes too
                    shutil.rmtree(entry.path, ignore_errors=True)
                    continue
                self._serve_apart(entry, manifest, running)
                prune_versions(path, {manifest.index_version, before})
            except Exception as exc:  # noqa: BLE001 (any failure: said, retried later; serving goes on)
                if not entry.path.exists():
                    continue  # dropped meanwhile
                self._failed_until[entry.id] = time.monotonic() + self.retry_s
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self.say(f"shardserve: collection {entry.name!r}: fold failed, next try in "
                         f"{self.retry_s:.0f} s: {why}")
                continue
            folded += 1
            self.folds += 1
            stage = "grown into" if manifest.build.params.get("grown_from") == before else "compacted as"
            self.say(f"shardserve: collection {entry.name!r} {stage} {manifest.index_factory} "
                     f"({manifest.num_vectors} points, {len(manifest.shards)} shards, log position "
                     f"{manifest.log_position})")
        return folded

    def _apart_apps(self, entries: list) -> set[str]:
        """The collections' applications running now, after deleting those of collections no longer
        live (dropped)."""
        if self.app_args is None:
            return set()
        from deployments.collection_apps import collection_of, running_apps
        from shardserve.runtime.ray_private import delete_app_nowait

        running = running_apps()
        live = {entry.id for entry in entries}
        for name in sorted(running):
            if collection_of(name) not in live:  # its router app, index apps, swapped versions alike
                self.say(f"shardserve: {name}: its collection is gone, deleting it")
                delete_app_nowait(name)
        return running

    def _serve_apart(self, entry, folded: Manifest | None, running: set[str]) -> None:
        """Deploy the collection apart once built past its `apart_at` (again, after a restart), and
        swap a new fold of it into its application."""
        if self.app_args is None:
            return
        from deployments.collection_apps import (
            APART_TIMEOUT_S,
            MAX_COLLECTIONS_APART,
            MIN_APART_AT,
            apart_app,
            app_of,
            collection_of,
            deploy_apart,
        )
        from deployments.swap import swap_index
        from index_build.grow import grown

        app = app_of(entry.id)
        if app in running and apart_app(entry.path) == app:
            if folded is not None:
                report = swap_index(str(entry.path), app, skip_gate=True, timeout_s=APART_TIMEOUT_S)
                self.say(f"shardserve: collection {entry.name!r}: {app} swapped to {report['new_version']}")
            return
        manifest = folded or read_manifest(Location.parse(str(entry.path)))
        threshold = max(entry.spec.apart_at, int(self.app_args.get("min_apart_at", MIN_APART_AT)))
        large = grown(manifest) and manifest.num_vectors >= threshold
        if apart_app(entry.path) is None and not large:
            return
        apart = {collection_of(name) for name in running} - {entry.id}
        limit = int(self.app_args.get("max_collections_apart", MAX_COLLECTIONS_APART))
        if apart_app(entry.path) is None and len(apart) >= limit:
            return  # the router replicas keep serving it
        deploy_apart(entry.id, entry.path, self.app_args, timeout_s=APART_TIMEOUT_S)
        self.say(f"shardserve: collection {entry.name!r} ({manifest.num_vectors} points) served apart by "
                 f"{app}: {len(manifest.shards)} shard deployments of its own")

    def _dropped(self, entry) -> bool:
        from shardserve.collection.catalogue import Catalogue

        catalogue = Catalogue(self.root, readonly=True)
        try:
            now = catalogue.get(entry.name)
        finally:
            catalogue.close()
        return now is None or now.id != entry.id

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 (the catalogue unreadable: said, tried again)
                with contextlib.suppress(Exception):  # its output gone: the folds go on regardless
                    self.say(f"shardserve: collections' folds failed: {exc}")
