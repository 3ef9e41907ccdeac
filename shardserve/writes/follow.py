"""A shard replica's side of the write log: it follows the log and answers over its base index plus
the writes applied so far (shardserve.writes.shard), at the newest committed position.

Why every search catches up first, and how that gives read-your-writes: a router acknowledges a
write once its commit is on disk (shardserve.writes.log). A search that starts after that 200
reaches a replica after the commit; the replica reads the log's newest position (one SQLite read,
tens of microseconds) and applies whatever it has not yet, before it searches. So any search through
any router, against any replica, sees every write acknowledged before it started, without a
position on the wire. A replica that restarts or that the autoscaler adds replays the log from its
version's `log_position` the same way, before its first answer.

Nothing is built until the log holds a request past the version's position: an index nobody writes
to answers exactly as before (the base searcher alone), and its replicas hold no delta.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardserve.index.partition import Partition
from shardserve.query.searcher import ShardSearcher
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.delta import MAX_DELTA_ROWS, ShardDelta
from shardserve.writes.locate import Log, LogAddress, open_log
from shardserve.writes.redis_log import LogUnavailable
from shardserve.writes.route import WriteRoute
from shardserve.writes.shard import ShardWithDelta

# Requests read from the log at once while catching up: a request holds up to 1,000 points
# (~3 MB at 784 dims), so this bounds one read's memory (and a Redis reply's) to ~100 MB.
logger = logging.getLogger(__name__)
READ_REQUESTS = 32
LOG_DOWN_BACKOFF_S = 1.0  # after the log failed to answer, searches skip it this long


class LogGap(RuntimeError):
    """The log no longer holds requests this replica needs: its version is older than what the log
    was truncated to, and only a newer version can serve."""


class ShardWrites:
    """One shard replica's base searcher plus the log's writes. `trained` returns the manifest's
    trained empty index (read only when the first write arrives). Thread-safe: searches on the event
    loop and in the search thread may catch up at once; one applies, the other waits for it."""

    def __init__(self, searcher: ShardSearcher, shard: int, shards: int, log_path: LogAddress | None,
                 base_position: int, trained: Callable[[], bytes | None], max_rows: int = MAX_DELTA_ROWS):
        self.searcher, self.shard, self.shards = searcher, shard, shards
        self.path, self.base_position, self.max_rows = log_path, base_position, max_rows
        self._trained = trained
        self._log: Log | None = None
        self._view: ShardWithDelta | None = None
        self._lock = threading.Lock()
        self.position = base_position
        self._log_down_until = 0.0

    @property
    def delta(self) -> ShardDelta | None:
        return None if self._view is None else self._view.delta

    def catch_up(self, required: bool = False) -> int:
        """Apply every request committed to the log before this call; return the position applied.
        When the log cannot be read (its Redis down), what was applied is served, and the log is
        tried again after LOG_DOWN_BACKOFF_S, unless `required` (a replica starting: it raises)."""
        if not required and time.monotonic() < self._log_down_until:
            return self.position
        try:
            return self._catch_up()
        except LogUnavailable as exc:
            if required:
                raise
            if time.monotonic() >= self._log_down_until + 60.0:  # said once a minute at most
                logger.warning("shard %d serves position %d: %s", self.shard, self.position, exc)
            self._log_down_until = time.monotonic() + LOG_DOWN_BACKOFF_S
            return self.position

    def _catch_up(self) -> int:
        log = self._log or self._open()
        if log is None:
            return self.position
        last = log.last_position()
        if last <= self.position:
            return self.position
        with self._lock:
            while self.position < last:
                requests = log.read(self.position, READ_REQUESTS)
                if not requests:
                    break
                if requests[0][0] != self.position + 1:
                    raise LogGap(f"shard {self.shard}: the write log starts at request {requests[0][0]}, "
                                 f"this replica has applied up to {self.position}: serve a newer version")
                view = self._view or self._start_delta()
                for position, ops in requests:
                    view.delta.apply(position, ops, bounded=False)  # acknowledged: held whatever the bound
                    self.position = position
        return self.position

    def answer(self, query: ShardQuery) -> tuple:
        """The shard's answer to a batch at the newest committed position (searcher.answer's shape)."""
        self.catch_up()
        view = self._view
        if view is None or (not view.delta.rows and not len(view.delta.tombstones)):
            return self.searcher.answer(query)  # nothing written here (yet): the base alone
        return view.answer(query)

    def lookup(self, ids: list[int], columns: list[str]) -> list[dict | None]:
        """`include`'s metadata of `ids`: the latest, None for ids this shard does not hold."""
        self.catch_up()
        if self._view is not None:
            return self._view.lookup(ids, columns)
        if self.searcher.metadata is None:
            return [None] * len(ids)
        return self.searcher.metadata.lookup(ids, columns)

    def ids_matching(self, where: str, limit: int) -> tuple[np.ndarray, int, int]:
        """(the live ids of this shard that pass a checked filter, how many, the log position they
        were found at) once every committed request is applied (LogUnavailable if the log cannot
        be read): a delete by filter deletes these, if the log is still there. More than `limit`:
        no ids, the count only."""
        self._catch_up()
        position, view = self.position, self._view
        found, position = view.ids_matching(where) if view is not None else (self.searcher.selected(where),
                                                                              position)
        return (found if len(found) <= limit else found[:0]), len(found), position

    def live_rows(self) -> int:
        delta = self.delta
        base = int(self.searcher.index.ntotal)
        return base if delta is None else base - len(delta.tombstones) + delta.rows

    def _open(self) -> Log | None:
        if self.path is None or (isinstance(self.path, Path) and not self.path.exists()):
            return None  # no write ever: nothing to follow (a Redis log answers position 0)
        with self._lock:
            if self._log is None:
                self._log = open_log(self.path, readonly=True)
        return self._log

    def _start_delta(self) -> ShardWithDelta:
        """The delta, built at the first request past the version's position (caller holds _lock).
        Upserts are dealt to shards by a hash of their id (shardserve.writes.route): every shard
        computes the same home without the build's partition, which the manifest does not keep."""
        route = WriteRoute(Partition(self.shards))
        delta = ShardDelta(self.searcher, self.shard, route, self._trained(), self.max_rows)
        delta.position = self.base_position
        self._view = ShardWithDelta(self.searcher, delta)
        return self._view
