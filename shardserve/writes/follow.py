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

A log can lose its newest requests (a restored file, a Redis failed over to a replica that was
behind, or flushed) and hand their positions out again (shardserve.writes.log: epochs). A replica
checks, in the same read as the newest position, that the log still holds the request it applied
last; when it does not, its delta holds writes the log no longer has and lacks ones it has, and no
delta can be un-applied: the replica drops it and replays the log from its version's position, as
a replica started now would, in a thread of its own (the search that found it may run on the
replica's event loop). Until that is done, or when the log no longer holds those requests, it
answers nothing as current (LogBehind).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardserve.errors import ShardserveError
from shardserve.index.partition import Partition
from shardserve.query.searcher import ShardSearcher
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.delta import MAX_DELTA_ROWS, ShardDelta
from shardserve.writes.locate import Log, LogAddress, open_log
from shardserve.writes.log import READ_BYTES as LOG_READ_BYTES
from shardserve.writes.log import Entry, Tip
from shardserve.writes.redis_log import LogUnavailable
from shardserve.writes.route import WriteRoute
from shardserve.writes.shard import ShardWithDelta, base_points
from shardserve.writes.tombstones import members, stored_ids

logger = logging.getLogger(__name__)
# Requests read from the log at once while catching up, and their bytes of vectors and metadata
# (the first request whatever its size): a request holds up to 1,000 points and each point up to
# 16 KiB of metadata, so the count alone would let one read (and a Redis reply) hold half a GB.
READ_REQUESTS = 32
READ_BYTES = LOG_READ_BYTES
LOG_DOWN_BACKOFF_S = 1.0  # after the log failed to answer, searches skip it this long


class LogGap(ShardserveError, RuntimeError):
    """The log no longer holds requests this replica needs: its version is older than what the log
    was truncated to, and only a newer version can serve."""


class LogBehind(ShardserveError, RuntimeError):
    """The log no longer holds requests this replica applied (it lost them), and the replica has
    not rebuilt its view from its version's position yet, or cannot (the log no longer holds those
    requests either): it answers nothing as current (the router: a 503)."""


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
        # the position applied and the epoch of the request there (None: nothing past the base),
        # one tuple replaced whole: a search's check reads both without the lock
        self._applied: tuple[int, int | None] = (base_position, None)
        self._lost: str | None = None  # the log lost what was applied; the view not rebuilt yet
        # views dropped so far: a search that read no view checks it did not read it mid-drop
        self._resets = 0
        self._rebuilding: threading.Thread | None = None
        self._rebuild_failed: str | None = None  # why the last rebuild stopped, if it did
        self._rebuild_after = 0.0  # a rebuild that failed is tried again from then on
        self._log_down_until = 0.0
        self._base_ids: np.ndarray | None = None  # the base's ids, sorted (made on first use)
        # told the traced requests of each read it applied, with when the read began and ended
        # (`time.time()`): the replica's part of each write's trace. None: nothing is timed.
        self.on_applied: Callable[[list[Entry], float, float], None] | None = None

    @property
    def position(self) -> int:
        """The log position applied: every request up to it is in the view."""
        return self._applied[0]

    @property
    def delta(self) -> ShardDelta | None:
        return None if self._view is None else self._view.delta

    def catch_up(self, required: bool = False) -> int:
        """Apply every request committed to the log before this call; return the position applied.
        When the log cannot be read (its Redis down), what was applied is served, and the log is
        tried again after LOG_DOWN_BACKOFF_S, unless `required` (a replica starting: it raises).
        LogBehind while the log no longer holds what was applied and the view is not rebuilt."""
        if not required and time.monotonic() < self._log_down_until:
            if self._lost is not None:
                raise self._refusal()
            return self.position
        try:
            return self._catch_up()
        except LogUnavailable as exc:
            if required:
                raise
            if time.monotonic() >= self._log_down_until + 60.0:  # said once a minute at most
                logger.warning("shard %d serves position %d: %s", self.shard, self.position, exc)
            self._log_down_until = time.monotonic() + LOG_DOWN_BACKOFF_S
            if self._lost is not None:  # what was applied is known to be wrong: not served
                raise LogBehind(f"{self._lost}; the log is unavailable to re-read: {exc}") from None
            return self.position

    def _catch_up(self) -> int:
        log = self._log or self._open()
        if log is None:
            return self.position
        position, epoch = self._applied
        if self._lost is None:  # a search's one read: the newest position and the epoch there
            tip = log.tip()
            if tip.position <= position and _holds(tip, position, epoch):
                return position
        # one thread applies, the others wait for it; while a rebuild holds the lock, they answer
        # LogBehind at once rather than wait out a replay of the whole log
        if not self._lock.acquire(blocking=self._lost is None):
            raise self._refusal()
        try:
            return self._apply(log)
        finally:
            self._lock.release()

    def _apply(self, log: Log) -> int:
        """Apply what the log holds past the position applied (caller holds _lock); LogBehind, and
        the view rebuilt meanwhile, when the log no longer holds the request applied last."""
        tip = log.tip()
        position, epoch = self._applied
        if self._lost is not None or not _holds(tip, position, epoch):
            raise self._behind(log, self._lost or self._why(position, tip.position))
        while self.position < tip.position:
            started = time.time() if self.on_applied is not None else 0.0
            entries = log.entries(self.position, READ_REQUESTS, max_bytes=READ_BYTES)
            if not entries:
                break
            position, epoch = self._applied
            if entries[0].position != position + 1:
                raise LogGap(f"shard {self.shard}: the write log starts at request {entries[0].position}, "
                             f"this replica has applied up to {position}: serve a newer version")
            if not _follows(entries[0], epoch):
                raise self._behind(log, self._why(position, tip.position))
            view = self._view or self._start_delta()
            for entry in entries:  # acknowledged: held whatever the bound
                try:
                    view.delta.apply(entry.position, entry.ops, bounded=False)
                except Exception as exc:  # the delta may be half-changed: never served as it is
                    raise self._behind(log, f"shard {self.shard}: applying request {entry.position} "
                                            f"failed ({type(exc).__name__}: {exc})") from exc
                self._applied = (entry.position, entry.epoch)
            if self.on_applied is not None and (traced := [entry for entry in entries if entry.trace]):
                self._tell(traced, started)
        return self.position

    def _tell(self, traced: list[Entry], started: float) -> None:
        """on_applied, whose failure is only logged: the requests are applied whatever it does."""
        assert self.on_applied is not None
        try:
            self.on_applied(traced, started, time.time())
        except Exception:
            logger.exception("shard %d: on_applied failed", self.shard)

    def _why(self, position: int, newest: int) -> str:
        return (f"shard {self.shard}: the write log no longer holds request {position} as this replica "
                f"applied it (the log is at {newest}: it lost requests)")

    def _behind(self, log: Log, why: str) -> LogBehind:
        """The view is wrong (caller holds _lock): dropped at once (it holds writes the log lost,
        and a delta cannot be un-applied), and rebuilt in a thread of its own, unless one runs or
        the last one failed less than LOG_DOWN_BACKOFF_S ago. Why a thread: the search that finds
        the loss may run on the replica's event loop, and a replay of the whole log would stall
        it. The LogBehind to raise meanwhile."""
        if self._lost is None:
            logger.warning("%s: rebuilding its view from position %d", why, self.base_position)
            self._resets += 1  # before the view goes: a reader that finds none then finds this
            self._lost, self._view, self._applied = why, None, (self.base_position, None)
        running = self._rebuilding is not None and self._rebuilding.is_alive()
        if not running and time.monotonic() >= self._rebuild_after:
            self._rebuilding = threading.Thread(target=self._rebuild, args=(log,), daemon=True,
                                                name=f"shard-{self.shard}-rebuild")
            self._rebuilding.start()  # it takes the lock once the caller lets it go
        return self._refusal()

    def _refusal(self) -> LogBehind:
        failed = f"; {self._rebuild_failed}" if self._rebuild_failed else ""
        return LogBehind(f"{self._lost or 'the view is being rebuilt'}{failed}")

    def _rebuild(self, log: Log) -> None:
        """The view a replica started now would build: the log replayed from the version's position
        into a new delta, put in place once whole. A failure is kept for the refusals (and tried
        again later): the log unavailable, changing again meanwhile, or no longer holding a
        request from the version's position on (then only a newer version can serve)."""
        with self._lock:
            try:
                view, applied = self._replay(log)
            except Exception as exc:
                if str(exc) != self._rebuild_failed:
                    logger.warning("shard %d: rebuilding its view failed: %s", self.shard, exc)
                self._rebuild_failed = str(exc)
                self._rebuild_after = time.monotonic() + LOG_DOWN_BACKOFF_S
                return
            self._view, self._applied, self._lost, self._rebuild_failed = view, applied, None, None
        logger.warning("shard %d: view rebuilt, at position %d", self.shard, applied[0])

    def _replay(self, log: Log) -> tuple[ShardWithDelta | None, tuple[int, int | None]]:
        view: ShardWithDelta | None = None
        position, epoch = self.base_position, None
        while position < log.tip().position:
            entries = log.entries(position, READ_REQUESTS, max_bytes=READ_BYTES)
            if not entries:
                break
            if entries[0].position != position + 1:
                raise LogBehind(f"the log no longer holds request {position + 1} either, past this "
                                f"replica's version (position {self.base_position}): serve a newer version")
            if not _follows(entries[0], epoch):
                raise LogBehind("the log changed again while this replica re-read it")
            view = view or self._new_view()
            for entry in entries:
                view.delta.apply(entry.position, entry.ops, bounded=False)
                position, epoch = entry.position, entry.epoch
        return view, (position, epoch)

    def answer(self, query: ShardQuery) -> tuple[np.ndarray, np.ndarray, float, int, int]:
        """The shard's answer to a batch at the newest committed position: (distances, ids, search
        ms, rows a filter matched, the log position the answer is the state at). The router keeps
        an id's copy from the newest position when two shards of one search answered at different
        ones (an overwrite moved it between them: shardserve.query.merge)."""
        resets = self._resets
        position = self.catch_up()
        view = self._current(resets)
        if view is None or (not view.delta.rows and not len(view.delta.tombstones)):
            # nothing written here (yet): the base alone, the state at any position up to now
            found = self.searcher.answer(query)
            return found[0], found[1], found[2], int(found[3]) if len(found) > 3 else 0, position
        return view.answer(query)

    def lookup(self, ids: list[int], columns: list[str]) -> list[dict | None]:
        """`include`'s metadata of `ids`: the latest, None for ids this shard does not hold."""
        resets = self._resets
        self.catch_up()
        view = self._current(resets)
        if view is not None:
            return view.lookup(ids, columns)
        if self.searcher.metadata is None:
            return [None] * len(ids)
        return self.searcher.metadata.lookup(ids, columns)

    def ids_matching(self, where: str, limit: int) -> tuple[np.ndarray, int, int]:
        """(the live ids of this shard that pass a checked filter, how many, the log position they
        were found at) once every committed request is applied (LogUnavailable if the log cannot
        be read): a delete by filter deletes these, if the log is still there. More than `limit`:
        no ids, the count only."""
        resets = self._resets
        self._catch_up()
        position, view = self.position, self._current(resets)
        found, position = view.ids_matching(where) if view is not None else (self.searcher.selected(where),
                                                                              position)
        return (found if len(found) <= limit else found[:0]), len(found), position

    def live_ids(self, where: str | None = None) -> tuple[np.ndarray, int]:
        """(every live id, passing a checked filter `where` when given, ascending and distinct; the
        log position that state is at), once every committed request is applied: a scroll's and a
        count's. It costs a pass over the shard's ids."""
        resets = self._resets
        position = self.catch_up()
        view = self._current(resets)
        if view is not None:
            return view.live_ids(where)
        if where is not None:
            return np.unique(self.searcher.selected(where)), position
        if self._base_ids is None:  # the base never changes: sorted once
            self._base_ids = np.sort(stored_ids(self.searcher.index))
        return self._base_ids, position

    def page(self, after: int | None, limit: int, where: str | None = None) -> np.ndarray:
        """A scroll page's part: the first `limit` live ids past `after` (passing a checked filter
        `where`), ascending, once every committed request is applied. Unfiltered, it costs about
        its own size; filtered, a pass over the ids that match."""
        if where is not None:
            ids, _ = self.live_ids(where)
        else:
            resets = self._resets
            self.catch_up()
            view = self._current(resets)
            if view is not None:
                return view.page(after, limit)
            ids, _ = self.live_ids()
        return ids[0 if after is None else int(np.searchsorted(ids, after, "right")):][:limit]

    def points(self, ids: list[int], columns: list[str],
               vectors: bool) -> tuple[list[dict | None], np.ndarray | None, int]:
        """ShardWithDelta.points, once every committed request is applied: a get by ids."""
        resets = self._resets
        position = self.catch_up()
        view = self._current(resets)
        if view is not None:
            return view.points(ids, columns, vectors)
        if self._base_ids is None:
            self._base_ids = np.sort(stored_ids(self.searcher.index))
        held = members(self._base_ids, ids)
        found: list[dict | None] = [None] * len(ids)
        matrix = np.zeros((len(ids), self.searcher.dim), np.float32) if vectors else None
        base_points(self.searcher, ids, np.flatnonzero(held).tolist(), columns, found, matrix)
        return found, matrix, position

    def _current(self, resets: int) -> ShardWithDelta | None:
        """The view to answer with, read after a catch-up that began with `resets` views dropped:
        LogBehind when one was dropped since (a rebuild that ended meanwhile included: without its
        check, a search that read no view mid-drop would answer from the base alone, deleted ids
        back)."""
        view = self._view
        if self._resets != resets or self._lost is not None:
            raise self._refusal()
        return view

    def close(self) -> None:
        """Let go of the log's connection (a replica letting this shard go); a later read opens it again."""
        with self._lock:
            log, self._log = self._log, None
        if log is not None:
            log.close()

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
        """The delta, built at the first request past the version's position (caller holds _lock)."""
        self._view = self._new_view()
        return self._view

    def _new_view(self) -> ShardWithDelta:
        """An empty delta over the base, at the version's position. Upserts are dealt to shards by
        a hash of their id (shardserve.writes.route): every shard computes the same home without
        the build's partition, which the manifest does not keep."""
        route = WriteRoute(Partition(self.shards))
        delta = ShardDelta(self.searcher, self.shard, route, self._trained(), self.max_rows)
        delta.position = self.base_position
        return ShardWithDelta(self.searcher, delta)


def _holds(tip: Tip, position: int, epoch: int | None) -> bool:
    """Whether a log whose newest request is `tip` may still hold the request at `position` that
    was applied with `epoch` (None: nothing applied past the version's position, nothing to lose).
    Past it, the next request's `prev` tells (_follows); an unknown epoch (the request truncated
    away, a log read as schema 1) is taken as held."""
    if epoch is None or tip.position > position:
        return True
    return tip.position == position and (tip.epoch is None or tip.epoch == epoch)


def _follows(entry: Entry, epoch: int | None) -> bool:
    """Whether `entry` was appended onto the request applied last, whose epoch was `epoch`."""
    return epoch is None or entry.prev is None or entry.prev == epoch
