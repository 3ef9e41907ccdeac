"""The write log on Redis, for a cluster: the same contract as the SQLite log
(shardserve.writes.log.WriteLog), in a Redis stream, so that it survives the loss of any Ray node,
the head included.

Why Redis: a cluster with GCS fault tolerance already runs one (Ray keeps its GCS state there), it
is a maintained engine with atomic scripts and an fsync'd append-only file, and a stream gives
ordered, range-readable entries keyed by their position. It is not on any Ray node: a node lost
takes none of the log with it. What a 200 promises rests on Redis's own durability: `appendonly
yes` with `appendfsync always` (Redis fsyncs the append-only file before it sends any reply, so
an acknowledged request survives a SIGKILL of Redis; tests/test_write_log.py does it). A writer
refuses a Redis whose CONFIG says otherwise; a managed Redis that hides CONFIG is taken as
configured (docs/operations.md says what to ask of it).

Layout, under one key prefix per index (`<prefix>` = `shardserve:log:{HASH}`, HASH a hash of the
index's root location, in braces so a Redis Cluster keeps the three keys in one slot):
- `<prefix>:seq`, the last position handed out (INCR: never reused, truncation or not);
- `<prefix>:requests`, a stream with one entry per request, its ID `<position>-0`, its fields the
  ids (int64), one kind byte per operation (1 upsert, 0 delete), the upserts' float32 vectors and
  their metadata (one orjson list), and the running totals of operations and upserts, so that a
  backlog is two lookups, not a scan;
- `<prefix>:totals`, those running totals at the newest request.

A request is appended by one Lua script (INCR, then XADD): Redis runs it whole, so a reader sees
all of a request or none of it, and positions are dense.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import orjson
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shardserve.errors import ShardserveError
from shardserve.writes.log import Backlog, LogMoved
from shardserve.writes.ops import Delete, Op, Upsert

WRITE_LOG_ENV = "SHARDSERVE_WRITE_LOG"  # redis://HOST:PORT[/DB]: the log of every index in Redis
PASSWORD_FILE_ENV = "SHARDSERVE_WRITE_LOG_PASSWORD_FILE"  # a file holding its password (never the URL)
TIMEOUT_S = 10.0  # a writer waits this long for Redis (its fsync included)
READ_TIMEOUT_S = 1.0  # a reader (a search catching up): then it serves what it has

# The next position is past the last one handed out, the stream's newest entry and the served
# version's position (ARGV[7]): a counter lost (a flushed or restored Redis, a log moved from
# SQLite) never hands out a position a replica would skip as applied. With ARGV[8] >= 0 (a
# conditional append, WriteLog.append's `unless_past`) a log already past it gets -1, nothing
# written. XADD runs first: if it refuses, the script has written nothing (Redis does not undo a
# script's earlier writes).
_APPEND = """
local position = tonumber(redis.call('GET', KEYS[1]) or '0')
local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if newest[1] then
  position = math.max(position, tonumber(string.match(newest[1][1], '^(%d+)')))
end
if tonumber(ARGV[8]) >= 0 and position > tonumber(ARGV[8]) then
  return -1
end
position = math.max(position, tonumber(ARGV[7])) + 1
local totals = redis.call('HMGET', KEYS[3], 'ops', 'upserts')
local ops = tonumber(totals[1] or '0') + tonumber(ARGV[5])
local upserts = tonumber(totals[2] or '0') + tonumber(ARGV[6])
local id = string.format('%d-0', position)
redis.call('XADD', KEYS[2], id, 'ids', ARGV[1], 'kinds', ARGV[2], 'vectors', ARGV[3],
           'metadata', ARGV[4], 'ops_total', ops, 'upserts_total', upserts)
redis.call('SET', KEYS[1], string.format('%d', position))
redis.call('HSET', KEYS[3], 'ops', ops, 'upserts', upserts)
return position
"""


@dataclass(frozen=True)
class RedisLogAddress:
    """Where one index's log lives in Redis: the server's URL (no password in it) and the key prefix."""

    url: str
    prefix: str

    @classmethod
    def for_index(cls, url: str, root: str) -> RedisLogAddress:
        """`url` checked: redis://HOST:PORT[/DB] only (no user, password or options: a password in
        it would be in every error message and log line that names the log, and options such as
        decode_responses would change what the log reads). The key prefix carries a hash tag, so
        a Redis Cluster keeps one index's keys in one slot (one script touches them all)."""
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if (parts.scheme != "redis" or not parts.hostname or parts.username is not None
                or parts.password is not None or parts.query or parts.fragment or port is None
                or parts.path.strip("/") not in ("", *map(str, range(16)))):
            shown = f"{parts.scheme}://{parts.hostname or ''}" + (f":{port}" if port else "")
            raise ValueError(f"{WRITE_LOG_ENV} must be redis://HOST:PORT[/DB] with nothing else (the "
                             f"password goes in the file {PASSWORD_FILE_ENV} names); got {shown}…")
        return cls(url, "shardserve:log:{" + hashlib.sha256(root.encode()).hexdigest()[:24] + "}")


def _password() -> str | None:
    path = os.environ.get(PASSWORD_FILE_ENV)
    return Path(path).read_text().strip() if path else None


class RedisWriteLog:
    """`RedisWriteLog(address)` appends; `readonly=True` only reads. WriteLog's methods and
    guarantees. Safe across threads (redis-py's connection pool)."""

    def __init__(self, address: RedisLogAddress, readonly: bool = False, password: str | None = None):
        self.address, self.readonly = address, readonly
        self.path = address.url  # what error messages name, as WriteLog's file path
        # No retries: a resent append whose first try did reach Redis would be a second request
        # (and could land after another router's delete of the same id). A failure is the
        # caller's: the router answers 503, the follower serves what it has applied.
        timeout = READ_TIMEOUT_S if readonly else TIMEOUT_S
        self._db = redis.Redis.from_url(address.url, password=password or _password(),
                                        socket_timeout=timeout, socket_connect_timeout=timeout,
                                        retry=Retry(NoBackoff(), 0))
        self._seq, self._stream, self._totals = (f"{address.prefix}:{name}"
                                                 for name in ("seq", "requests", "totals"))
        self._append = self._db.register_script(_APPEND)
        self._lock = threading.Lock()
        if not readonly:
            self._check_durable()

    def _check_durable(self) -> None:
        try:
            with _unavailable(self.address):
                raw: Any = {**self._db.config_get("append*"), **self._db.config_get("maxmemory-policy")}
        except redis.ResponseError:  # CONFIG renamed or denied (a managed Redis): taken as configured
            return
        config = {_text(k): _text(v) for k, v in raw.items()}
        wanted = {"appendonly": "yes", "appendfsync": "always", "maxmemory-policy": "noeviction"}
        wrong = {k: config.get(k) for k, v in wanted.items() if config.get(k) != v}
        if wrong:
            raise RuntimeError(f"write log {self.address.url}: Redis must run with {wanted} (it has "
                               f"{wrong}): a 200 would not survive its loss or its memory's eviction")

    def close(self) -> None:
        self._db.close()

    def exists(self) -> bool:
        """Whether any request was ever appended."""
        return bool(self._db.exists(self._seq))

    def append(self, ops: list[Op], after: int = 0, unless_past: int | None = None) -> int:
        """Write one request (all its operations, or none) and return its log position (past
        `after`, the served version's), once Redis answered (after its fsync): the caller may
        acknowledge it then. LogUnavailable when Redis cannot be reached: nothing acknowledged.
        `unless_past`: as WriteLog.append (checked inside the script)."""
        if not ops:
            raise ValueError("a write request needs at least one operation")
        if self.readonly:
            raise RuntimeError("a read-only write log cannot append")
        ids = np.array([op.id for op in ops], np.int64)
        kinds = np.array([isinstance(op, Upsert) for op in ops], np.uint8)
        upserts = [op for op in ops if isinstance(op, Upsert)]
        vectors = b"".join(np.ascontiguousarray(op.vector, np.float32).tobytes() for op in upserts)
        metadata = orjson.dumps([op.metadata for op in upserts])
        condition = -1 if unless_past is None else unless_past
        with self._lock, _unavailable(self.address):
            position = int(self._append(keys=[self._seq, self._stream, self._totals],
                                        args=[ids.tobytes(), kinds.tobytes(), vectors, metadata, len(ops),
                                              len(upserts), after, condition]))
        if position < 0:
            raise LogMoved(f"the log holds requests past {unless_past}")
        return position

    def read(self, after: int, limit: int = 1000, vectors: bool = True) -> list[tuple[int, list[Op]]]:
        """Up to `limit` requests past position `after`, oldest first: (position, its operations).
        `vectors` is read either way (a request is one stream entry; XRANGE returns its fields
        whole): a caller that does not need them bounds its reads by `limit`."""
        with _unavailable(self.address):
            entries: Any = self._db.xrange(self._stream, min=f"{after + 1}-0", max="+", count=limit)
        return [(_position(entry_id), _ops(fields)) for entry_id, fields in entries]

    def last_position(self) -> int:
        """The newest request's position (0: none ever), truncation or not."""
        with _unavailable(self.address):
            value = self._db.get(self._seq)
        return int(value) if value is not None else 0

    def backlog(self, position: int) -> Backlog:
        """The requests past `position` up to the newest: from the running totals of the first
        and the last entries past it (one pipeline: a consistent snapshot, as Redis runs it whole)."""
        pipe = self._db.pipeline(transaction=True)
        pipe.xrange(self._stream, min=f"{position + 1}-0", max="+", count=1)
        pipe.xrevrange(self._stream, max="+", min="-", count=1)
        pipe.get(self._seq)
        with _unavailable(self.address):
            first, newest, seq = pipe.execute()
        last = int(seq) if seq is not None else 0
        if not first or not newest:
            return Backlog(last, 0, 0)
        head, tail = first[0][1], newest[0][1]
        ops_before = int(head[b"ops_total"]) - len(np.frombuffer(head[b"kinds"], np.uint8))
        upserts_before = int(head[b"upserts_total"]) - int(np.frombuffer(head[b"kinds"], np.uint8).sum())
        return Backlog(last, int(tail[b"ops_total"]) - ops_before,
                       int(tail[b"upserts_total"]) - upserts_before)

    def first_position(self) -> int | None:
        """The oldest request still kept (None: none kept)."""
        entries: Any = self._db.xrange(self._stream, min="-", max="+", count=1)
        return _position(entries[0][0]) if entries else None

    def truncate_below(self, position: int) -> None:
        """Forget the requests before `position` (every kept index version includes them)."""
        if self.readonly:
            raise RuntimeError("a read-only write log cannot truncate")
        self._db.xtrim(self._stream, minid=f"{position}-0", approximate=False)


class LogUnavailable(ShardserveError):
    """The write log's Redis did not answer (down, unreachable, or slower than TIMEOUT_S)."""


@contextlib.contextmanager
def _unavailable(address: RedisLogAddress) -> Iterator[None]:
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise LogUnavailable(f"write log {address.url} unavailable: {type(exc).__name__}") from None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _position(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


def _ops(fields: dict[bytes, bytes]) -> list[Op]:
    ids = np.frombuffer(fields[b"ids"], np.int64).tolist()
    kinds = np.frombuffer(fields[b"kinds"], np.uint8)
    count = int(kinds.sum())
    vectors = np.frombuffer(fields[b"vectors"], np.float32).reshape(count, -1) if count else None
    metadata = orjson.loads(fields[b"metadata"])
    ops: list[Op] = []
    upsert = 0
    for id_, kind in zip(ids, kinds.tolist(), strict=True):
        if kind:
            assert vectors is not None
            ops.append(Upsert(id_, vectors[upsert].copy(), metadata[upsert]))
            upsert += 1
        else:
            ops.append(Delete(id_))
    return ops
