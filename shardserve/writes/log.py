"""The write log: every acknowledged write request, in order, on SQLite in WAL mode with
synchronous=FULL.

Why SQLite and not a file format of our own: the log is what a 200 promises, and an engine that
is maintained, fuzzed and used everywhere already gets atomic commits, torn-write recovery and
concurrent readers right. WAL mode lets readers in other processes (every replica of every shard)
read committed requests while the one writer appends; synchronous=FULL makes a commit wait for the
WAL's fsync, so an acknowledged request is meant to survive a power cut too, not only a process
kill (the tests kill processes; no power cut is tested). It ships with
Python (stdlib sqlite3): nothing to deploy for the single-node default. The SQLite file must sit on
a local disk (WAL needs shared memory between its processes: no network filesystems).

A request is its row in `requests` (whose position is the log position, an AUTOINCREMENT key:
never reused, even after truncation) and one row per operation, written in one transaction with
any requests that queued behind it (`append_many`, the router's group commit). All or nothing: a
reader or a restart sees the whole request or none of it. A delete is an operation without a
vector. Vectors are float32 bytes, metadata JSON (orjson: integers exact to 64 bits).

Why each request records an epoch: a log that lost its newest requests (a file restored from a
copy; on Redis, a failover to a replica that was behind) hands their positions out again, and a
running replica that applied the lost ones would take the new requests there for requests it has.
So a position names a request only with its epoch: each writer (each `WriteLog` that appends)
draws a random one, and draws another when it finds the log's newest position below one it wrote
(the log lost requests under it). A request records its writer's epoch and the epoch of the
request before it (`prev`), and `tip()` reads the newest position with the epoch there in the
one statement a search already made: a replica (shardserve.writes.follow) sees that the request
it applied last is no longer the log's, whether the log is behind it, level with it or past it.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson

from shardserve.errors import BadArgument, ShardserveError, WriteLogError
from shardserve.index.manifest import MANIFEST, VERSIONS_DIR
from shardserve.index.storage import Location
from shardserve.writes.ops import Delete, Op, Upsert

SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    position INTEGER PRIMARY KEY AUTOINCREMENT,
    ops INTEGER NOT NULL,
    epoch INTEGER,
    prev INTEGER,
    bytes INTEGER,
    trace TEXT
);
CREATE TABLE IF NOT EXISTS ops (
    position INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    id INTEGER NOT NULL,
    vector BLOB,
    metadata BLOB,
    PRIMARY KEY (position, seq)
) WITHOUT ROWID;
"""
# The columns added to `requests` since schema 1: its writer's epoch, the epoch of the request at
# position - 1 when it was written (NULL: none there), the bytes of its vectors and metadata (schema
# 2); the W3C `traceparent` of a traced write (NULL: not traced), whose span each replica's apply is
# recorded under. A writer adds them to an older log when it opens it; the requests already there
# keep NULL (epoch 0, no prev, their bytes counted from their operations when read, untraced).
# `trace` is optional, found by its column, not by a schema version: a writer of an earlier release
# (which refuses a log whose version is above its own) still appends to a log that has it, NULL.
_ADDED = {"epoch": "INTEGER", "prev": "INTEGER", "bytes": "INTEGER", "trace": "TEXT"}
EPOCHS_SCHEMA = 2
WRITE_LOG = "writes/log.sqlite"  # in the index directory, beside manifest.json and versions/
BUSY_TIMEOUT_MS = 10_000  # a reader or a checkpoint holding a lock: wait, do not fail the write
# Bytes of vectors and metadata one read returns at most (always one request at least): a request
# may hold 1,000 points of 16 KiB of metadata each, so a count of requests alone bounds nothing.
READ_BYTES = 32 << 20


class Backlog(NamedTuple):
    last: int  # the newest request's position
    operations: int  # upserts and deletes past the position asked about
    upserts: int
    bytes: int  # their float32 vectors and each point's metadata JSON


class Tip(NamedTuple):
    """The newest position, and the epoch of the request there (0: written before epochs; None:
    not known here, the request truncated away or the log read as schema 1)."""

    position: int
    epoch: int | None


class Entry(NamedTuple):
    """A request as a follower reads it: its position, its writer's epoch (0: written before
    epochs), the epoch the request before it had when it was written (None: no request there, or
    not known), its operations, and the `traceparent` of its write when traced (None: not)."""

    position: int
    epoch: int
    prev: int | None
    ops: list[Op]
    trace: str | None = None


def new_epoch() -> int:
    """A writer's epoch: random, never 0 (the requests written before epochs)."""
    return 1 + secrets.randbelow((1 << 63) - 1)


class LogMoved(ShardserveError, RuntimeError):
    """A conditional append found requests past the position it was conditioned on: nothing written."""


class WriteLog:
    """`WriteLog(path)` opens (creating) the log to append to (`create=False`: only if it exists);
    `WriteLog(path, readonly=True)` reads what a writer in another process committed. Safe across
    threads (one connection, one lock)."""

    def __init__(self, path: str | Path, readonly: bool = False, create: bool = True):
        if sqlite3.sqlite_version_info < (3, 35):  # INSERT ... RETURNING (append)
            raise WriteLogError(f"the write log needs SQLite 3.35 or newer; Python here links "
                                f"{sqlite3.sqlite_version}")
        self.path = Path(path)
        self.readonly = readonly
        if readonly:  # read-write at the file level (a WAL reader may have to create the -shm
            # file after a clean shutdown removed it), never creating the database, never writing
            uri = f"file:{self.path}?mode=rw"
            self._db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA query_only = ON")
        elif not create:  # an existing log only (FileNotFound-like sqlite3.OperationalError otherwise)
            self._db = sqlite3.connect(f"file:{self.path}?mode=rw", uri=True, isolation_level=None,
                                       check_same_thread=False)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if not readonly:
            mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise WriteLogError(f"write log {self.path}: SQLite refused WAL mode (got {mode!r}): "
                                    "is it on a network filesystem?")
            self._db.executescript(_SCHEMA)
            self._migrate()
        # per connection: every commit of this one waits for the WAL's fsync
        self._db.execute("PRAGMA synchronous = FULL")
        if self._db.execute("PRAGMA synchronous").fetchone()[0] != 2:
            raise WriteLogError(f"write log {self.path}: synchronous=FULL was not applied")
        self._schema = self._schema_version()  # a reader of an older log reads it as such
        self._traced = self._has_trace()
        # this writer's epoch, the one it takes when it finds the log lost requests, and the newest
        # position it appended (the log's newest below it: lost requests)
        self._epoch, self._fresh, self._high = new_epoch(), new_epoch(), 0

    def _migrate(self) -> None:
        """An older log gets the current schema's columns (in one transaction, whichever writer first)."""
        cursor = self._db.cursor()
        cursor.execute("BEGIN IMMEDIATE")
        try:
            version = cursor.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise WriteLogError(f"write log {self.path}: schema {version}, written by a newer "
                                    f"shardserve (this one knows {SCHEMA_VERSION})")
            columns = {row[1] for row in cursor.execute("PRAGMA table_info(requests)").fetchall()}
            for name, kind in _ADDED.items():
                if name not in columns:
                    cursor.execute(f"ALTER TABLE requests ADD COLUMN {name} {kind}")
            cursor.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            cursor.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                cursor.execute("ROLLBACK")
            raise

    def _schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _has_trace(self) -> bool:
        return any(row[1] == "trace" for row in self._db.execute("PRAGMA table_info(requests)").fetchall())

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def append(self, ops: list[Op], after: int = 0, unless_past: int | None = None,
               trace: str | None = None) -> int:
        """Write one request (all its operations, or none) and return its log position, once the
        commit is on disk: the caller may acknowledge it then. The position is past `after` (the
        served version's): a log that lost its newest requests (a file restored from a backup)
        never hands out a position a replica of that version would skip as already applied (one
        that applied lost requests past it tells them by their epochs). `unless_past`: raise
        LogMoved instead, writing nothing, when the log holds a request past that position (checked
        in the same transaction as the write: a delete by filter evaluated at that position).
        `trace`: the traced write's `traceparent` (validated by the caller), kept for the replicas."""
        return self.append_many([ops], after, unless_past, [trace])[0]

    def append_many(self, requests: list[list[Op]], after: int = 0, unless_past: int | None = None,
                    traces: Sequence[str | None] | None = None) -> list[int]:
        """Write several requests in one transaction (all of them, or none), at consecutive
        positions, and return them once the commit is on disk: a group commit, one fsync for the
        requests that waited behind each other (WriteFront). `after`, `unless_past`, `traces` (one
        a request, or None): as `append`."""
        if not requests or not all(requests):
            raise BadArgument("a write request needs at least one operation")
        traces = [None] * len(requests) if traces is None else traces
        if len(traces) != len(requests):
            raise BadArgument(f"{len(traces)} traces for {len(requests)} requests")
        rows = [[_row(seq, op) for seq, op in enumerate(ops)] for ops in requests]
        positions, epochs = [], []
        with self._lock:
            cursor = self._db.cursor()
            cursor.execute("BEGIN IMMEDIATE")  # the write lock now: no other writer interleaves
            try:
                for ops, request_rows, trace in zip(requests, rows, traces, strict=True):
                    # the newest position read and the request's row written in one statement: a
                    # router appends beside its searches, and each statement is a GIL hand-off there
                    size = sum(len(v or b"") + len(m or b"") for _, _, v, m in request_rows)
                    row = cursor.execute(_INSERT_REQUEST, (after, len(ops), unless_past, self._high,
                                                           self._fresh, self._epoch, size, trace)).fetchall()
                    if not row:
                        raise LogMoved(f"the log is at {_newest(cursor)}, past {unless_past}")
                    positions.append(int(row[0][0]))
                    epochs.append(int(row[0][1]))
                    unless_past = None if unless_past is None else positions[-1]  # ours, then
                    cursor.executemany("INSERT INTO ops (position, seq, id, vector, metadata) VALUES "
                                       "(?, ?, ?, ?, ?)", [(positions[-1], *r) for r in request_rows])
                cursor.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    cursor.execute("ROLLBACK")
                raise
            self._high = max(self._high, positions[-1])
            if self._fresh in epochs:  # the log had lost requests this writer wrote: a new epoch
                self._epoch, self._fresh = self._fresh, new_epoch()
        return positions

    def read(self, after: int, limit: int = 1000, vectors: bool = True,
             max_bytes: int = READ_BYTES) -> list[tuple[int, list[Op]]]:
        """Up to `limit` requests past position `after`, oldest first: (position, its operations),
        no more than `max_bytes` of vectors and metadata (the first request whatever its size).
        One statement: one consistent snapshot, whatever the writer commits meanwhile (a replica
        reads the log once per write it applies: one statement costs a third of a transaction's
        four). `vectors` False: upserts come with an empty vector (a delete by filter reads only
        ids and metadata; the budget still counts them)."""
        return [(entry.position, entry.ops) for entry in self.entries(after, limit, vectors, max_bytes)]

    def entries(self, after: int, limit: int = 1000, vectors: bool = True,
                max_bytes: int = READ_BYTES) -> list[Entry]:
        """`read`, with each request's epochs (a follower checks that the log still holds the
        request it applied last: the first one's `prev` is its epoch) and trace."""
        vector = "o.vector" if vectors else "CASE WHEN o.vector IS NULL THEN NULL ELSE x'' END"
        with self._lock:
            if self._schema < SCHEMA_VERSION or not self._traced:  # a writer may have migrated it
                self._schema, self._traced = self._schema_version(), self._has_trace()
            found = self._db.execute(_read_statement(vector, self._schema, self._traced),
                                     (after, limit, max_bytes)).fetchall()
        requests: dict[int, list[Op]] = {}
        heads: dict[int, tuple[int, int, int | None, str | None]] = {}
        for position, count, epoch, prev, trace, id_, vector_, metadata in found:
            requests.setdefault(position, []).append(_op(id_, vector_, metadata))
            heads[position] = count, epoch, prev, trace
        for position, (count, _, _, _) in heads.items():
            if len(requests[position]) != count:  # SQLite's transactions make this impossible
                raise WriteLogError(f"write log {self.path}: request {position} holds "
                                    f"{len(requests[position])} of its {count} operations")
        return [Entry(position, int(head[1]), head[2], ops, head[3])
                for position, ops in requests.items() for head in (heads[position],)]

    def tip(self) -> Tip:
        """The newest position and the epoch of the request there, in one statement (a replica
        makes it before every search, where it made `last_position`: one statement still)."""
        if self._schema < EPOCHS_SCHEMA:
            return Tip(self.last_position(), None)
        with self._lock:
            try:
                rows = self._db.execute(_TIP).fetchall()
            except sqlite3.OperationalError as exc:  # a reader opened the file before its schema
                if "no such table" not in str(exc):
                    raise
                return Tip(0, None)
        return Tip(int(rows[0][0]), rows[0][1]) if rows else Tip(0, None)

    def last_position(self) -> int:
        """The newest request's position (0: none ever, or the writer has not created the tables
        yet), truncation or not."""
        with self._lock:
            try:
                rows = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'requests'").fetchall()
            except sqlite3.OperationalError as exc:  # a reader opened the file before its schema
                if "no such table" not in str(exc):
                    raise
                return 0
        # fetchall: the statement runs to its end, so its read transaction ends here, not at the next
        return int(rows[0][0]) if rows else 0

    def backlog(self, position: int) -> Backlog:
        """What the requests past `position` hold, up to the newest (one snapshot): the upserts a
        served version has not folded in yet and their bytes (the router's bounds), and all the
        operations a compaction of it would fold (automatic compaction's threshold). length() of
        a blob reads its header, not its pages."""
        with self._lock:
            cursor = self._db.cursor()
            cursor.execute("BEGIN")
            try:
                last = _newest(cursor)
                operations, upserts, size = cursor.execute(
                    "SELECT count(*), count(vector), coalesce(sum(length(vector)), 0) + "
                    "coalesce(sum(length(metadata)), 0) FROM ops WHERE position > ? AND position <= ?",
                    (position, last)).fetchone()
            finally:
                cursor.execute("COMMIT")
        return Backlog(last, int(operations), int(upserts), int(size))

    def first_position(self) -> int | None:
        """The oldest request still kept (None: none kept). A replica that applied less than
        first_position() - 1 cannot catch up from the log: it needs a newer base version."""
        with self._lock:
            row = self._db.execute("SELECT min(position) FROM requests").fetchone()
        return None if row[0] is None else int(row[0])

    def truncate_below(self, position: int) -> None:
        """Forget the requests before `position` (every kept index version includes them)."""
        with self._lock:
            cursor = self._db.cursor()
            cursor.execute("BEGIN IMMEDIATE")
            try:
                cursor.execute("DELETE FROM ops WHERE position < ?", (position,))
                cursor.execute("DELETE FROM requests WHERE position < ?", (position,))
                cursor.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    cursor.execute("ROLLBACK")
                raise


def log_path(index: str | Location) -> Path | None:
    """Where the write log of the index at `index` (its directory, or one of its published version
    directories) lives; None when the index is not on a local disk (the log needs one: WAL mode
    shares memory between its processes, which network filesystems and object stores cannot)."""
    local = Location.of(index).local_path(MANIFEST)
    if local is None:
        return None
    root = Path(local).resolve().parent
    if root.parent.name == VERSIONS_DIR:  # a published version: the log is its index's
        root = root.parent.parent
    return root / WRITE_LOG


_NEWEST = "coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'requests'), 0)"
# A request's row at max(newest, after) + 1, unless the log is past `unless_past` (NULL: always),
# with the writer's epoch, or its fresh one when the log's newest is below the newest position it
# wrote (?4), and the epoch of the request before it (NULL: none there). ?1 after, ?2 its operations,
# ?3 unless_past, ?5 the fresh epoch, ?6 the writer's, ?7 its bytes, ?8 its traceparent.
_INSERT_REQUEST = ("INSERT INTO requests (position, ops, epoch, prev, bytes, trace) "
                   "SELECT at + 1, ?2, CASE WHEN newest < ?4 THEN ?5 ELSE ?6 END, "
                   "(SELECT coalesce(epoch, 0) FROM requests WHERE position = at), ?7, ?8 "
                   f"FROM (SELECT newest, max(newest, ?1) AS at FROM (SELECT {_NEWEST} AS newest)) "
                   "WHERE ?3 IS NULL OR newest <= ?3 RETURNING position, epoch")
_TIP = ("SELECT seq, (SELECT coalesce(epoch, 0) FROM requests WHERE position = seq) "
        "FROM sqlite_sequence WHERE name = 'requests'")
# A request's bytes as its operations hold them (schema 1 did not record them)
_COUNTED = ("(SELECT coalesce(sum(length(vector)), 0) + coalesce(sum(length(metadata)), 0) "
            "FROM ops WHERE ops.position = requests.position)")


def _read_statement(vector: str, schema: int, traced: bool) -> str:
    """The requests past ?1, at most ?2 of them and ?3 bytes (the first whatever its size), joined to
    their operations: the byte budget is a running sum over the requests the limit took first.
    `schema`, `traced`: the log's version, and whether it has the trace column (an older log lacks
    the columns added since)."""
    epoch, prev, size = (("coalesce(epoch, 0)", "prev", f"coalesce(bytes, {_COUNTED})")
                         if schema >= EPOCHS_SCHEMA else ("0", "NULL", _COUNTED))
    trace = "trace" if traced else "NULL"
    return (f"SELECT r.position, r.ops, r.epoch, r.prev, r.trace, o.id, {vector}, o.metadata FROM "
            "(SELECT position, ops, epoch, prev, trace, size, "
            "sum(size) OVER (ORDER BY position ROWS UNBOUNDED PRECEDING) AS upto FROM "
            f"(SELECT position, ops, {epoch} AS epoch, {prev} AS prev, {trace} AS trace, {size} AS size "
            "FROM requests "
            "WHERE position > ?1 ORDER BY position LIMIT ?2)) AS r "
            "JOIN ops AS o ON o.position = r.position WHERE r.upto <= ?3 OR r.upto = r.size "
            "ORDER BY o.position, o.seq")


def _newest(cursor: sqlite3.Cursor) -> int:
    """The newest request's position, inside the caller's transaction (0: none ever)."""
    row = cursor.execute("SELECT seq FROM sqlite_sequence WHERE name = 'requests'").fetchone()
    return 0 if row is None else int(row[0])


def _row(seq: int, op: Op) -> tuple[int, int, bytes | None, bytes | None]:
    if isinstance(op, Delete):
        return seq, op.id, None, None
    vector = np.ascontiguousarray(op.vector, np.float32).tobytes()
    return seq, op.id, vector, None if op.metadata is None else orjson.dumps(op.metadata)


def _op(id_: int, vector: bytes | None, metadata: bytes | None) -> Op:
    if vector is None:
        return Delete(id_)
    meta = None if metadata is None else orjson.loads(metadata)
    return Upsert(id_, np.frombuffer(vector, np.float32), meta)
