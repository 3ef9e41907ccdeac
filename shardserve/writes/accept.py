"""The router's write path, plain Python: a write request's body checked against the served index
(shardserve.writes.parse), the backlog bounded, the request appended to the log, the answer.

A 200 is sent only once `WriteLog.append` returned: the request is committed and fsynced, so it
survives a SIGKILL of any process (loadtests/crash_writes.py kills each; a power cut is what
the fsync is for, untested here), and every shard replica applies it before its next
answer (shardserve.writes.follow). Nothing before the append changes any state: a refused request
(422, 503) left nothing behind.

Backpressure: every upsert since the served version's `log_position` sits in some shard's delta
(memory) until compaction folds it into a new version. The router refuses an upsert that would
take the log's backlog past one delta's bound, in points and in bytes of vectors and metadata (a
bound on the largest delta whatever the dealing: a delta holds at most every upsert; the compactor
and the replicas' log reads hold at most the backlog too), with a 503 + Retry-After; deletes are
always taken (a tombstone is a bit per base row, bounded by the base).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field

import orjson
import pyarrow as pa

from shardserve.index.manifest import Manifest
from shardserve.index.removal import writes_refused
from shardserve.query.api import ApiError
from shardserve.writes.delta import MAX_DELTA_ROWS
from shardserve.writes.follow import READ_REQUESTS
from shardserve.writes.locate import Log, LogAddress, open_log
from shardserve.writes.log import LogMoved, WriteLog
from shardserve.writes.ops import Delete, Op, Upsert
from shardserve.writes.parse import parse_delete, parse_delete_npy, parse_upsert, parse_upsert_npy
from shardserve.writes.redis_log import LogUnavailable, OutcomeUnknown
from shardserve.writes.roll import Carried, Found, metadata_schema

logger = logging.getLogger(__name__)

MAX_WRITE_POINTS = 1000  # ids per write request (GET /v1/index: max_write_points)
# Ids one delete by filter may delete (GET /v1/index: max_filter_delete_points): the matching ids go
# to the log as one request (a row each), read 32 requests at a time by every replica
# (writes.follow.READ_REQUESTS) and applied under its delta's lock: ten times a request by ids.
MAX_FILTER_DELETE = 10_000
# Bytes of vectors and metadata (as the log stores them) the upserts not yet compacted may hold (GET
# /v1/index: max_write_backlog_bytes): 200,000 points of 784 float32 dims are 627 MB; a point's
# metadata is bounded (writes.parse.MAX_METADATA_BYTES), and this bounds their sum.
MAX_BACKLOG_BYTES = 1 << 30


# Operations one group commit writes at most (WriteFront._drain): its rows are copied for SQLite at
# once, so this bounds that copy (~12 MB at 784 dims) whatever queued behind the writes thread.
GROUP_POINTS = 4 * MAX_WRITE_POINTS
SWAP_TRIES = 3  # a queued write's group found another index served before its append: then a 503
FILTER_DELETE_TRIES = 3  # evaluations of one delete by filter while swaps move the log, then a 503
ROLL_TRIES = 20  # carry-forwards of one evaluation while writes land between a read and the append
# (each shard's live matching ids and its log position, how many, the schema the shards hold
# metadata in: None, the router builds one from the manifest's kinds)
Matches = tuple[list[Found], int, "pa.Schema | None"]
# a delete by filter evaluated on the version served when it was: its shards' matches, its manifest,
# its log, and the filter as checked against its columns
Evaluated = tuple[Matches, Manifest, "LogAddress | None", str]


@dataclass(frozen=True)
class FilterDelete:
    """A delete by filter, evaluated: each shard's matches (`found`), the checked filter, and the
    schema to evaluate it on the upserts logged since (shardserve.writes.roll)."""

    found: list[Found]
    where: str
    schema: pa.Schema
    limit: int


async def delete_matching(front: WriteFront, evaluate: Callable[[], Awaitable[Evaluated]],
                          served: Callable[[], tuple[Manifest, LogAddress | None]] | None = None,
                          limit: int = MAX_FILTER_DELETE, tries: int = FILTER_DELETE_TRIES) -> dict:
    """A delete by filter: `evaluate()` reads the version served, checks the filter against its
    columns and gathers every shard's matching ids and the log position it found them at; in the
    writes thread they are carried forward through the requests logged since
    (shardserve.writes.roll) and deleted by id, on the condition that the log has not moved past
    what was read (a conditional append; a miss reads the new requests). So the delete takes
    effect exactly on the state the log is in when it is appended, whatever the ingest beside it.
    One at a time per front; more than `limit` matches: a 422, no ids moved. A swap to another
    index meanwhile: evaluated again, on the index then served (its shards, its columns, its
    log); a 503 once `tries` evaluations each found the server moved on before their append."""
    if front.deleting:
        raise ApiError(503, None, "a delete by filter is already running here", front.retry_after_s)
    front.deleting = True
    try:
        for _ in range(tries):
            try:  # LogMoved: the server moved to another index since `evaluate` read it
                (found, count, held), manifest, log, where = await evaluate()
                if log is None:  # the served version's log (the front's own may still be the last index's)
                    raise front.no_log()
                schema = held if held is not None else metadata_schema(manifest.dataset.metadata_kinds)
                if count > limit:
                    raise front.too_many(count, limit)
                matches = FilterDelete(found, where, schema, limit)
                return await front.accept(matches, False, manifest, log, served)
            except LogMoved:
                continue
        raise ApiError(503, None, f"the served index kept changing while the filter was evaluated ({tries} "
                                  "times): send it again", front.retry_after_s)
    finally:
        front.deleting = False


Served = Callable[[], tuple[Manifest, "LogAddress | None"]]


@dataclass
class WriteTrace:
    """A traced write's way through the front: the `traceparent` the log keeps with it (each replica
    records its apply under it), and when (`time.time()`) it was parsed, queued for the writes
    thread, and when the group commit it rode in began and ended, with that group's requests."""

    traceparent: str
    arrived: float = 0.0
    queued: float = 0.0
    commit_started: float = 0.0
    committed: float = 0.0
    group: int = 0


@dataclass(frozen=True, eq=False)  # one request is itself only: found in the queue by identity
class Queued:
    """A write request parsed on the event loop, waiting for the writes thread (WriteFront._drain)."""

    body: bytes
    upsert: bool
    manifest: Manifest  # the version it was parsed against
    path: LogAddress | None  # that version's log
    served: Served | None
    npy: bool
    ops: list[Op]
    done: Future
    trace: WriteTrace | None = field(default=None)


def _settle(done: Future, answer: dict | None = None, error: BaseException | None = None) -> None:
    """A queued request's answer, unless it has one: the first error of a group leaves the answers
    already given, and a request whose client went away (its future cancelled) is answered nobody."""
    try:
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(answer)
    except InvalidStateError:
        pass


class Same(enum.Enum):
    """`log` not given: the log this front already writes to."""

    SAME = 0


SAME = Same.SAME


class WriteFront:
    """`upsert(body, manifest)` / `delete(body, manifest)` → the JSON answer, or ApiError. Blocking
    (parsing and the log's fsync); `accept` runs them in this front's own thread, in arrival order.
    `path` None: the index has no write log (on remote storage, no Redis log configured), and
    writes are refused with a 501 saying so."""

    def __init__(self, path: LogAddress | None, max_points: int = MAX_WRITE_POINTS,
                 max_backlog: int = MAX_DELTA_ROWS, retry_after_s: int = 1, max_waiting: int = 256,
                 on_commit: Callable[[int], None] | None = None, max_backlog_bytes: int = MAX_BACKLOG_BYTES,
                 thread: ThreadPoolExecutor | None = None, create_log: bool = True):
        self.path, self.max_points, self.max_backlog = path, max_points, max_backlog
        self.max_backlog_bytes = max_backlog_bytes
        self.on_commit = on_commit  # told the requests of each commit (the router's metric)
        self.retry_after_s, self.max_waiting, self.waiting = retry_after_s, max_waiting, 0
        self._log: Log | None = None
        self._lock = threading.Lock()
        # (the log, its base position, counted up to, upserts, their bytes): one tuple, replaced whole
        self._counted: tuple[LogAddress | None, int, int, int, int] = (path, -1, 0, 0, 0)
        self._exact = False  # `_counted` is the log's count: every request since it was ours
        # the writes thread: its own, or one shared by many fronts (a collection each), not closed here
        self._own_thread = thread is None
        self._create_log = create_log  # False: the log must exist (a collection's: made with it)
        self._thread = ThreadPoolExecutor(1, "writes") if thread is None else thread
        self._queued: deque[Queued] = deque()  # parsed, in arrival order, for the next group commit
        # a drain is submitted and has not read the queue yet: a request queued now is its, so one
        # hand-off to the writes thread per group, not per request (set on the loop, cleared there)
        self._drain_due = False
        self.deleting = False  # a delete by filter in progress (delete_matching)

    async def accept(self, body: bytes | FilterDelete, upsert: bool, manifest: Manifest,
                     log: LogAddress | None | Same = SAME,
                     served: Callable[[], tuple[Manifest, LogAddress | None]] | None = None,
                     npy: bool = False, trace: WriteTrace | None = None) -> dict:
        """A write request from an event loop (`npy`: a .npy body): parsed here, as a search is,
        then appended in the writes thread; a 503 at once when `max_waiting` are already waiting
        for it. `log`: the served version's log, when a swap may have moved the server onto another
        index (its own log) since the last write. `body` a FilterDelete: a delete by filter,
        evaluated (delete_matching); LogMoved if `log` is no longer the one served. `served`: read
        again in the writes thread just before the append, since a swap may land while the request
        waits behind others there (a body is then parsed again against the version served).
        `trace`: a traced write's, stamped on its way (and its traceparent logged with it).

        Why the parse is not in the writes thread: the router's event loop is busy with searches,
        and every time a thread beside it runs Python code, it takes the GIL from the loop (a
        hand-off, two context switches): parsing on the loop, with few SQLite statements in the
        thread, leaves the searches beside writes more of it. The thread keeps the append, whose
        commit waits for an fsync: on the loop, an fsync on a slow disk would stall every search in
        the router (docs/experiments.md has the A/B of both)."""
        if self.waiting >= self.max_waiting:
            raise ApiError(503, None, f"overloaded: {self.waiting} writes waiting", self.retry_after_s)
        writable(manifest)  # a kind compaction cannot fold writes into: never taken, never a 503
        path = self.path if log is SAME else log
        if upsert and self._known_full(path, manifest.log_position):  # at once: no parse, no hand-off
            raise self._backlog_full()
        if path is None and not isinstance(body, FilterDelete):
            raise self.no_log()
        self.waiting += 1
        try:
            if isinstance(body, FilterDelete):
                return await asyncio.get_running_loop().run_in_executor(
                    self._thread, self._filter_delete, body, manifest, path, served)
            if trace is not None:
                trace.arrived = time.time()
            ops = self._parse(body, upsert, manifest, npy)
            queued = Queued(body, upsert, manifest, path, served, npy, ops, Future(), trace)
            if trace is not None:
                trace.queued = time.time()
            self._queued.append(queued)
            if not self._drain_due:  # else a drain not started yet takes this one too
                self._drain_due = True
                try:
                    self._thread.submit(self._drain)
                except BaseException:  # closed (RuntimeError), or anything: no drain is coming for it,
                    self._drain_due = False  # so the next request submits one; this one is refused,
                    if queued in self._queued:  # unless a drain took it already (then answered)
                        self._queued.remove(queued)
                        raise
            return await asyncio.wrap_future(queued.done)
        finally:
            self.waiting -= 1

    def check_upsert(self, body: bytes, manifest: Manifest, log: LogAddress | None | Same = SAME) -> None:
        """What `accept` would refuse this upsert for now, raised now: the body against `manifest`,
        and whether the write could be taken (no log, the backlog full, too many waiting). For a
        write whose body is costly to complete (texts to embed), checked before that work."""
        if self.waiting >= self.max_waiting:
            raise ApiError(503, None, f"overloaded: {self.waiting} writes waiting", self.retry_after_s)
        writable(manifest)
        path = self.path if log is SAME else log
        if self._known_full(path, manifest.log_position):
            raise self._backlog_full()
        if path is None:
            raise self.no_log()
        self._parse(body, True, manifest)

    def _filter_delete(self, body: FilterDelete, manifest: Manifest, path: LogAddress | None,
                       served: Served | None) -> dict:
        now, where = served() if served is not None else (manifest, path)
        if where != path:
            raise LogMoved("the server moved to another index while the filter was evaluated")
        return self._delete_found(body, now, where, served)

    def _drain(self) -> None:
        """In the writes thread: every request queued so far, appended as one group per log (a group
        commit: one transaction and one fsync for the requests that waited behind each other, so
        the shards read them in one go too). A request whose client went away first is dropped
        unwritten. Each goes to the index served when its group is appended: `served` is read for
        each, and again just before each group's append; a request whose turn finds another index
        served is parsed again against it (one that no longer fits gets its own 422)."""
        self._drain_due = False  # before the queue is read: what is queued after this submits again
        pending = []
        while self._queued:
            item = self._queued.popleft()
            if item.done.set_running_or_notify_cancel():  # False: cancelled, its client gone
                pending.append(item)
        for _ in range(SWAP_TRIES):
            if not pending:
                return
            pending = self._append_groups(pending)
        for item in pending:  # swapped away under it each time
            _settle(item.done, error=ApiError(503, None, "the served index kept changing while the write "
                                                         "waited: send it again", self.retry_after_s))

    def _append_groups(self, pending: list[Queued]) -> list[Queued]:
        """`pending` in groups of consecutive requests for one log, each group appended; what is left
        when a swap landed before a group's append (that group and those after it)."""
        groups: list[tuple[Manifest, LogAddress | None, list[tuple[Queued, list[Op]]]]] = []
        for item in pending:
            try:
                now, where = item.served() if item.served is not None else (item.manifest, item.path)
                ops = item.ops if now is item.manifest else self._parse(item.body, item.upsert, now, item.npy)
            except BaseException as exc:  # its own answer, whatever it is
                _settle(item.done, error=exc)
                continue
            if (groups and groups[-1][0] is now and groups[-1][1] == where
                    and sum(len(o) for _, o in groups[-1][2]) + len(ops) <= GROUP_POINTS):
                groups[-1][2].append((item, ops))
            else:
                groups.append((now, where, [(item, ops)]))
        for at, (manifest, log, items) in enumerate(groups):
            try:
                if not self._append_group(items, manifest, log):
                    return [item for _, _, rest in groups[at:] for item, _ in rest]
            except BaseException as exc:  # for those not answered yet: nothing of theirs written
                unavailable = isinstance(exc, LogUnavailable)
                error = ApiError(503, None, str(exc), self.retry_after_s) if unavailable else exc
                for item, _ in items:
                    _settle(item.done, error=error)
        return []

    def _append_group(self, items: list[tuple[Queued, list[Op]]], manifest: Manifest,
                      log: LogAddress | None) -> bool:
        """Append `items` to `log` past `manifest`'s position (`_log_requests`), each answered once it
        is on disk. False, nothing written: another index is served by now (`served`, read again)."""
        served = items[0][0].served
        if served is not None:
            now, where = served()
            if now is not manifest or where != log:
                return False
        self._use(log)
        if self.path is None:
            raise self.no_log()

        traces = [item.trace for item, _ in items]
        traced = any(trace is not None for trace in traces)
        logged = [None if t is None else t.traceparent for t in traces] if traced else None
        started = time.time() if traced else 0.0

        def answer(n: int, position: int | ApiError) -> None:
            item, ops = items[n]
            trace = item.trace
            if trace is not None:  # stamped before its answer: the router reads it once answered
                trace.commit_started, trace.committed, trace.group = started, time.time(), len(items)
            if isinstance(position, ApiError):
                _settle(item.done, error=position)
            else:
                _settle(item.done, {"position": position, "upserted" if item.upsert else "deleted": len(ops)})

        with self._lock:
            self._log_requests([ops for _, ops in items], manifest, answer, traces=logged)
        return True

    def _log_requests(self, requests: list[list[Op]], manifest: Manifest,
                      answer: Callable[[int, int | ApiError], None], unless_past: int | None = None,
                      traces: Sequence[str | None] | None = None) -> None:
        """The one append: `requests` to this front's log past `manifest`'s position, in order, each
        `answer`ed by its index with its position once it is on disk, or with the 503 that refused it
        alone (it would take the backlog past its bound). SQLite takes them in one transaction (a
        group commit), Redis one script call each (answered as each lands). `unless_past`: the
        conditional append of a delete by filter (LogMoved, nothing written). `traces`: each request's
        traceparent (None: none traced), logged with it. Errors (the log unavailable, LogMoved) are
        raised for the requests not answered yet. Caller holds _lock."""
        assert self.path is not None, "callers answer a front without a log with no_log()"
        if self._log is None:
            self._log = open_log(self.path, create=self._create_log)
        taken: list[tuple[int, list[Op], int, int]] = []
        backlog: tuple[int, int] | None = None
        for n, ops in enumerate(requests):
            adding = sum(isinstance(op, Upsert) for op in ops)
            size = sum(upsert_bytes(op) for op in ops if isinstance(op, Upsert))
            if adding:
                backlog = self.backlog(manifest.log_position) if backlog is None else backlog
                if backlog[0] + adding > self.max_backlog or backlog[1] + size > self.max_backlog_bytes:
                    answer(n, self._backlog_full())
                    continue
                backlog = (backlog[0] + adding, backlog[1] + size)
            taken.append((n, ops, adding, size))
        if not taken:
            return
        assert unless_past is None or len(requests) == 1, "a conditional append is one request"
        logged = [None if traces is None else traces[n] for n, _, _, _ in taken]
        together = (self._log.append_many([ops for _, ops, _, _ in taken], manifest.log_position, unless_past,
                                          logged) if isinstance(self._log, WriteLog) else None)
        for at, (n, ops, adding, size) in enumerate(taken):
            try:
                position = (self._log.append(ops, manifest.log_position, unless_past, logged[at])
                            if together is None else together[at])
            except OutcomeUnknown as exc:  # this one may be written; those after it were never sent
                self._exact = False  # the next backlog check counts the log
                answer(n, ApiError(503, None, str(exc), self.retry_after_s))
                if at == len(taken) - 1:
                    raise
                raise LogUnavailable("the write log did not answer a request sent before this one: "
                                     "not written") from None
            self._appended(position, adding, size)
            answer(n, position)
            if together is None:
                self._committed(1)
        if together is not None:
            self._committed(len(together))

    def _committed(self, requests: int) -> None:
        """Tell `on_commit`; whatever it raises, the requests are on disk and answered as such."""
        if self.on_commit is not None:
            try:
                self.on_commit(requests)
            except Exception:
                logger.exception("write front: on_commit failed")

    def _delete_found(self, matches: FilterDelete, manifest: Manifest, log: LogAddress | None,
                      served: Callable[[], tuple[Manifest, LogAddress | None]] | None = None) -> dict:
        """A delete by filter's ids, carried forward to the log's newest request and appended if the
        log is still there (else carried on through what landed since); nothing matching: nothing
        written. `served` is read again before each append: a swap to another index while this
        carries (reads can take a while behind a long ingest) is LogMoved, evaluated again there."""
        carried = Carried(matches.found, matches.where, matches.schema)
        self._use(log)  # the log the shards found them in, not the last one this front wrote to
        for _ in range(ROLL_TRIES):
            with self._lock:
                try:
                    if self._log is None and self.path is not None:
                        self._log = open_log(self.path, create=self._create_log)
                    if self._log is None:
                        raise self.no_log()
                    self._carry(carried)
                except LogUnavailable as exc:  # nothing written: the client may send it again
                    raise ApiError(503, None, str(exc), self.retry_after_s) from None
            if served is not None and served()[1] != log:  # before any answer, "deleted 0" included
                raise LogMoved("the server moved to another index while the matches were carried")
            ids = carried.ids()
            if len(ids) > matches.limit:
                raise self.too_many(len(ids), matches.limit)
            if not len(ids):
                return {"position": None, "deleted": 0}
            try:
                return {"position": self._append([Delete(int(i)) for i in ids.tolist()], manifest, log,
                                                 unless_past=carried.position), "deleted": len(ids)}
            except LogMoved:
                continue
        raise ApiError(503, None, f"writes kept landing between reading the log and the append ({ROLL_TRIES} "
                                  "times): send it again", self.retry_after_s)

    def _carry(self, carried: Carried) -> None:
        """Carry `carried` through every request logged past its position (caller holds _lock), read
        as the replicas read, READ_REQUESTS at a time and here without their vectors: what is held
        is the matching ids, never the requests. A log truncated past it (a compaction folded them
        away): a 503, the delete may be sent again."""
        assert self._log is not None
        while True:
            more = self._log.read(carried.position, READ_REQUESTS, vectors=False)
            if more[0][0] != carried.position + 1 if more else self._truncated_past(carried.position):
                raise ApiError(503, None, "the write log was truncated while the filter was evaluated: send "
                                          "it again", self.retry_after_s)
            if not more:  # a read bounded by bytes may return fewer than asked while more remain
                return
            carried.through(more)

    def _truncated_past(self, position: int) -> bool:
        """Nothing read past `position`: because nothing was appended since (False), or because all
        of it was folded away (True; else the conditional append would miss every time)."""
        assert self._log is not None
        if self._log.last_position() <= position:
            return False
        first = self._log.first_position()  # read after: a request appended meanwhile is kept
        return first is None or first > position + 1

    @staticmethod
    def too_many(count: int, limit: int) -> ApiError:
        return ApiError(422, "filter", f"the filter matches {count} points, more than {limit} in one delete "
                                       "(max_filter_delete_points): narrow it, or delete in parts")

    def _parse(self, body: bytes, upsert: bool, manifest: Manifest, npy: bool = False) -> list[Op]:
        writable(manifest)  # again for a request parsed anew against the version a swap brought
        if npy:
            return list(parse_upsert_npy(body, manifest.dim, manifest.metric, self.max_points) if upsert
                        else parse_delete_npy(body, self.max_points))
        if upsert:
            return list(parse_upsert(body, manifest.dim, manifest.metric, manifest.dataset.metadata_kinds,
                                     self.max_points))
        return list(parse_delete(body, self.max_points))

    def upsert(self, body: bytes, manifest: Manifest, log: LogAddress | None | Same = SAME) -> dict:
        writable(manifest)
        ops = parse_upsert(body, manifest.dim, manifest.metric, manifest.dataset.metadata_kinds,
                           self.max_points)
        return {"position": self._append(ops, manifest, log), "upserted": len(ops)}

    def delete(self, body: bytes, manifest: Manifest, log: LogAddress | None | Same = SAME) -> dict:
        writable(manifest)
        ops = parse_delete(body, self.max_points)
        return {"position": self._append(ops, manifest, log), "deleted": len(ops)}

    def backlog(self, base_position: int) -> tuple[int, int]:
        """(upserts, their bytes) in the log past `base_position` (caller holds _lock): counted in the
        log from where the last count ended, unless the log's newest request is still the last one counted
        (`_appended` counts this front's own: with one writer, the usual case, one read of the
        newest position replaces a counting transaction). As before, another router may append
        between this check and the append: the bound may be passed by what they append at once."""
        assert self._log is not None
        _, base, counted_to, upserts, size = self._counted
        if base != base_position:
            counted_to, upserts, size = base_position, 0, 0
        elif self._exact and self._log.last_position() == counted_to:
            return upserts, size
        found = self._log.backlog(counted_to)
        self._counted = (self.path, base_position, found.last, upserts + found.upserts, size + found.bytes)
        self._exact = True
        return upserts + found.upserts, size + found.bytes

    def _appended(self, position: int, upserts: int, size: int) -> None:
        """This front appended `position` holding `upserts` upserts of `size` bytes (caller holds
        _lock): the count stays exact when it directly follows what was counted, else the next check
        counts the log."""
        path, base, counted_to, counted, counted_bytes = self._counted
        self._exact = self._exact and position == counted_to + 1
        if self._exact:
            self._counted = (path, base, position, counted + upserts, counted_bytes + size)

    def close(self) -> None:
        if self._own_thread:
            self._thread.shutdown(wait=True)
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None

    def no_log(self) -> ApiError:
        return ApiError(501, None, "writes need the index on a local disk (the write log is a SQLite "
                                   "file beside its manifest) or a Redis write log "
                                   "(SHARDSERVE_WRITE_LOG): this index is on remote storage")

    def _append(self, ops: Sequence[Op], manifest: Manifest, log: LogAddress | None | Same = SAME,
                unless_past: int | None = None) -> int:
        """One request appended now, in the calling thread (a group of one): its position, or the
        ApiError that refused it."""
        self._use(log)
        if self.path is None:
            raise self.no_log()
        answers: list[int | ApiError] = []
        with self._lock:
            try:
                self._log_requests([list(ops)], manifest, lambda _, position: answers.append(position),
                                   unless_past)
            except LogUnavailable as exc:  # nothing acknowledged: the client may send it again
                raise ApiError(503, None, str(exc), self.retry_after_s) from None
        if isinstance(answers[0], ApiError):
            raise answers[0]
        return answers[0]

    def _use(self, log: LogAddress | None | Same) -> None:
        """Write to `log` from now on, when the server now serves another index (its own log)."""
        if log is not SAME and log != self.path:
            with self._lock:
                if self._log is not None:
                    self._log.close()
                self.path, self._log, self._counted, self._exact = log, None, (log, -1, 0, 0, 0), False

    def _known_full(self, path: LogAddress | None, base_position: int) -> bool:
        """The backlog past `base_position` was already at its bound when last counted: it only
        grows until a new version (another base position) is served, so any upsert is refused."""
        counted, base, _, upserts, size = self._counted  # one tuple, replaced whole by the writes thread
        return counted == path and base == base_position and (upserts >= self.max_backlog
                                                              or size >= self.max_backlog_bytes)

    def _backlog_full(self) -> ApiError:
        return ApiError(503, None, f"write backlog full: at most {self.max_backlog} upserts or "
                                   f"{self.max_backlog_bytes} bytes of vectors and metadata wait to be "
                                   "compacted into a new index version (`shardserve compact`)",
                        self.retry_after_s)


def upsert_bytes(op: Upsert) -> int:
    """What an upsert takes in the log and in a delta: its float32 vector and its metadata's JSON
    (the backlog's byte bound; the logs count it the same way)."""
    return 4 * len(op.vector) + (0 if op.metadata is None else len(orjson.dumps(op.metadata)))


def writable(manifest: Manifest) -> None:
    """A 501 naming the kind when `manifest`'s index is of a kind compaction cannot fold writes
    into (shardserve.index.removal.writes_refused, cached per factory): such a write would be held
    in every replica's memory for good, and the backlog would then refuse every upsert."""
    refused = writes_refused(manifest.index_factory, manifest.dim, manifest.metric)
    if refused is not None:
        raise ApiError(501, None, refused)
