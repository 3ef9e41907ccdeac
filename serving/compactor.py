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

import threading
from collections.abc import Callable

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
