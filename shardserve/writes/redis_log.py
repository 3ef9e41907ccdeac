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
index's root location, in braces so a Redis Cluster keeps its keys in one slot):
- `<prefix>:seq`, the last position handed out (never reused, truncation or not);
- `<prefix>:tip`, the epoch of the request at that position (shardserve.writes.log says why
  epochs: a Redis failed over to a replica that was behind, or flushed, hands positions out again);
- `<prefix>:requests`, a stream with one entry per request, its ID `<position>-0`, its fields the
  ids (int64), one kind byte per operation (1 upsert, 0 delete), the upserts' float32 vectors and
  their metadata (one orjson list), its bytes (vectors and each point's metadata), the running
  totals of operations, upserts and bytes, so that a backlog is two lookups, not a scan, its
  writer's epoch and the epoch of the request before it (`prev`), and a traced write's
  `traceparent` (`trace`, only on those);
- `<prefix>:totals`, those running totals at the newest request.

A request is appended by one Lua script (XADD, then the counters): Redis runs it whole, so a reader
sees all of a request or none of it, and positions are dense. Requests logged before epochs and
byte counts have neither: epoch 0, and no bytes in a backlog.

An append whose script was sent and whose answer did not come (the writer's timeout, a connection
lost) may still be run by Redis: OutcomeUnknown says so, where a Redis that could not be reached
at all is LogUnavailable (nothing written). No append is resent by the server.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import orjson
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shardserve import settings
from shardserve.errors import BadArgument, ShardserveError, WriteLogError
from shardserve.writes.log import READ_BYTES, Backlog, Entry, LogMoved, Tip, new_epoch
from shardserve.writes.ops import Delete, Op, Upsert

# the log's two settings (shardserve.settings), re-exported: the messages below name them
WRITE_LOG_ENV, PASSWORD_FILE_ENV = settings.WRITE_LOG_ENV, settings.PASSWORD_FILE_ENV

TIMEOUT_S = 10.0  # a writer waits this long for Redis (its fsync included)
READ_TIMEOUT_S = 1.0  # a reader (a search catching up): then it serves what it has

# The next position is past the last one handed out, the stream's newest entry and the served
# version's position (ARGV[7]): a counter lost (a flushed or restored Redis, a log moved from
# SQLite) never hands out a position a replica would skip as applied. With ARGV[8] >= 0 (a
# conditional append, WriteLog.append's `unless_past`) a log already past it gets -1, nothing
# written. The request takes the writer's epoch (ARGV[10]), or its fresh one (ARGV[11]) when the
# log's newest is below the newest position the writer appended (ARGV[9]: the log lost requests),
# and records the epoch at the position before it (none: ''). ARGV[12]: its bytes; ARGV[13]: its
# traceparent ('': not traced, no field). XADD runs
# first: if it refuses, the script has written nothing (Redis does not undo a script's earlier
# writes). Epochs stay strings here: Lua's numbers hold 53 bits.
_APPEND = """
local seq = redis.call('GET', KEYS[1])
local position = tonumber(seq or '0')
local prev = redis.call('GET', KEYS[4]) or (seq and '0')
local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if newest[1] then
  local at = tonumber(string.match(newest[1][1], '^(%d+)'))
  if at > position then
    position, prev = at, '0'
    local fields = newest[1][2]
    for i = 1, #fields, 2 do
      if fields[i] == 'epoch' then prev = fields[i + 1] end
    end
  end
end
if tonumber(ARGV[8]) >= 0 and position > tonumber(ARGV[8]) then
  return {-1, ''}
end
local epoch = ARGV[10]
if position < tonumber(ARGV[9]) then
  epoch = ARGV[11]
end
if tonumber(ARGV[7]) > position then
  position, prev = tonumber(ARGV[7]), false
end
position = position + 1
local totals = redis.call('HMGET', KEYS[3], 'ops', 'upserts', 'bytes')
local ops = tonumber(totals[1] or '0') + tonumber(ARGV[5])
local upserts = tonumber(totals[2] or '0') + tonumber(ARGV[6])
local bytes = tonumber(totals[3] or '0') + tonumber(ARGV[12])
local id = string.format('%d-0', position)
local fields = {'ids', ARGV[1], 'kinds', ARGV[2], 'vectors', ARGV[3], 'metadata', ARGV[4],
                'bytes', ARGV[12], 'ops_total', ops, 'upserts_total', upserts, 'bytes_total', bytes,
                'epoch', epoch, 'prev', prev or ''}
if ARGV[13] ~= '' then
  fields[#fields + 1], fields[#fields + 2] = 'trace', ARGV[13]
end
redis.call('XADD', KEYS[2], id, unpack(fields))
redis.call('SET', KEYS[1], string.format('%d', position))
redis.call('SET', KEYS[4], epoch)
redis.call('HSET', KEYS[3], 'ops', ops, 'upserts', upserts, 'bytes', bytes)
return {position, epoch}
"""
# The entries past ARGV[1], at most ARGV[2] of them and ARGV[3] bytes (the first whatever its size),
# their vectors left out unless ARGV[4] is '1': XRANGE cannot stop at a size, so a script reads one
# entry at a time (Redis copies what it reads into the script: never more than the budget and one
# entry) and stops there (an entry logged before byte counts: its blobs' lengths).
_READ = """
local out, used, start = {}, 0, tonumber(ARGV[1]) + 1
local limit, budget = tonumber(ARGV[2]), tonumber(ARGV[3])
while #out < limit do
  local batch = redis.call('XRANGE', KEYS[1], string.format('%d-0', start), '+', 'COUNT', 1)
  if not batch[1] then
    return out
  end
  for _, entry in ipairs(batch) do
    local fields, size, counted = entry[2], 0, nil
    for i = 1, #fields, 2 do
      local name = fields[i]
      if name == 'bytes' then
        counted = tonumber(fields[i + 1])
      elseif name == 'vectors' or name == 'metadata' then
        size = size + #fields[i + 1]
        if name == 'vectors' and ARGV[4] ~= '1' then fields[i + 1] = '' end
      end
    end
    size = counted or size
    if #out > 0 and used + size > budget then
      return out
    end
    used = used + size
    out[#out + 1] = entry
    start = tonumber(string.match(entry[1], '^(%d+)')) + 1
  end
end
return out
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
            raise BadArgument(f"{WRITE_LOG_ENV} must be redis://HOST:PORT[/DB] with nothing else (the "
                              f"password goes in the file {PASSWORD_FILE_ENV} names); got {shown}…")
        return cls(url, "shardserve:log:{" + hashlib.sha256(root.encode()).hexdigest()[:24] + "}")


def _password() -> str | None:
    path = settings.write_log_password_file()
    return path.read_text().strip() if path else None


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
        self._seq, self._stream, self._totals, self._tip = (f"{address.prefix}:{name}"
                                                            for name in ("seq", "requests", "totals", "tip"))
        self._append = self._db.register_script(_APPEND)
        self._read = self._db.register_script(_READ)
        self._lock = threading.Lock()
        # as WriteLog's: this writer's epoch, its next one, the newest position it appended
        self._epoch, self._fresh, self._high = new_epoch(), new_epoch(), 0
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
            raise WriteLogError(f"write log {self.address.url}: Redis must run with {wanted} (it has "
                                f"{wrong}): a 200 would not survive its loss or its memory's eviction")

    def close(self) -> None:
        self._db.close()

    def exists(self) -> bool:
        """Whether any request was ever appended."""
        with _unavailable(self.address):
            return bool(self._db.exists(self._seq))

    def append(self, ops: list[Op], after: int = 0, unless_past: int | None = None,
               trace: str | None = None) -> int:
        """Write one request (all its operations, or none) and return its log position (past
        `after`, the served version's), once Redis answered (after its fsync): the caller may
        acknowledge it then. LogUnavailable when Redis cannot be reached: nothing written;
        OutcomeUnknown (a LogUnavailable) when the script was sent and no answer came: it may have
        been written. `unless_past`, `trace`: as WriteLog.append (checked inside the script)."""
        if not ops:
            raise BadArgument("a write request needs at least one operation")
        if self.readonly:
            raise WriteLogError("a read-only write log cannot append")
        ids = np.array([op.id for op in ops], np.int64)
        kinds = np.array([isinstance(op, Upsert) for op in ops], np.uint8)
        upserts = [op for op in ops if isinstance(op, Upsert)]
        vectors = b"".join(np.ascontiguousarray(op.vector, np.float32).tobytes() for op in upserts)
        metas = [op.metadata for op in upserts]
        metadata = orjson.dumps(metas)
        # each point's JSON: the list's, less its brackets and commas (n + 1) and its nulls'
        size = len(vectors) + (len(metadata) - len(metas) - 1 - 4 * metas.count(None) if metas else 0)
        condition = -1 if unless_past is None else unless_past
        with self._lock:
            try:
                position, epoch = self._run_append([ids.tobytes(), kinds.tobytes(), vectors, metadata,
                                                    len(ops), len(upserts), after, condition, self._high,
                                                    self._epoch, self._fresh, size, trace or ""])
            except OutcomeUnknown:
                # Redis may hold it under this epoch and lose it in a failover: the next request
                # must not be taken, at that same position, for the one a replica applied
                self._epoch, self._fresh = self._fresh, new_epoch()
                raise
            if position < 0:
                raise LogMoved(f"the log holds requests past {unless_past}")
            self._high = max(self._high, int(position))
            if int(epoch) == self._fresh:  # the log had lost requests this writer wrote: a new epoch
                self._epoch, self._fresh = self._fresh, new_epoch()
        return int(position)

    def _run_append(self, args: list) -> Any:
        """The append script on a connection of its own (caller holds _lock): a failure to connect
        sent nothing (LogUnavailable), a failure after that may have run it (OutcomeUnknown)."""
        keys = [self._seq, self._stream, self._totals, self._tip]
        pool = self._db.connection_pool
        with _unavailable(self.address):
            connection = pool.get_connection()  # connected and checked: nothing sent yet
        try:
            connection.send_command("EVALSHA", self._append.sha, len(keys), *keys, *args)
            try:
                return self._db.parse_response(connection, "EVALSHA")
            except redis.exceptions.NoScriptError:  # a restarted or flushed Redis: EVAL caches it
                connection.send_command("EVAL", _APPEND, len(keys), *keys, *args)
                return self._db.parse_response(connection, "EVAL")
        except redis.ResponseError:  # answered: the script refused, whole
            raise
        except BaseException as exc:  # its answer may be unread on the connection: never reused
            connection.disconnect()
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                raise OutcomeUnknown(f"write log {self.address.url}: no answer to an append once it "
                                     f"was sent ({type(exc).__name__}): the request may have been "
                                     "written") from None
            raise
        finally:
            pool.release(connection)

    def read(self, after: int, limit: int = 1000, vectors: bool = True,
             max_bytes: int = READ_BYTES) -> list[tuple[int, list[Op]]]:
        """Up to `limit` requests past position `after`, oldest first: (position, its operations),
        no more than `max_bytes` of vectors and metadata (the first request whatever its size).
        `vectors` False: upserts come with an empty vector (Redis still reads them: one stream
        entry a request; the reply leaves them out)."""
        return [(entry.position, entry.ops) for entry in self.entries(after, limit, vectors, max_bytes)]

    def entries(self, after: int, limit: int = 1000, vectors: bool = True,
                max_bytes: int = READ_BYTES) -> list[Entry]:
        """`read`, with each request's epochs and trace (WriteLog.entries)."""
        with _unavailable(self.address):
            found: Any = self._read(keys=[self._stream],
                                    args=[after, limit, max_bytes, "1" if vectors else "0"])
        entries = []
        for entry_id, flat in found:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            prev, trace = fields.get(b"prev"), fields.get(b"trace")
            entries.append(Entry(_position(entry_id), int(fields.get(b"epoch", 0)),
                                 int(prev) if prev else None, _ops(fields), trace and trace.decode()))
        return entries

    def tip(self) -> Tip:
        """The newest position and the epoch of the request there, in one command (a replica makes
        it before every search)."""
        with _unavailable(self.address):
            seq, epoch = self._db.mget(self._seq, self._tip)
        if seq is None:
            return Tip(0, None)
        return Tip(int(seq), int(epoch) if epoch is not None else 0)  # no tip: logged before epochs

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
            return Backlog(last, 0, 0, 0)
        head, tail = first[0][1], newest[0][1]
        kinds = np.frombuffer(head[b"kinds"], np.uint8)
        ops_before = int(head[b"ops_total"]) - len(kinds)
        upserts_before = int(head[b"upserts_total"]) - int(kinds.sum())
        # entries logged before byte counts count none
        bytes_before = int(head.get(b"bytes_total", 0)) - int(head.get(b"bytes", 0))
        return Backlog(last, int(tail[b"ops_total"]) - ops_before,
                       int(tail[b"upserts_total"]) - upserts_before,
                       int(tail.get(b"bytes_total", 0)) - bytes_before)

    def first_position(self) -> int | None:
        """The oldest request still kept (None: none kept)."""
        with _unavailable(self.address):
            entries: Any = self._db.xrange(self._stream, min="-", max="+", count=1)
        return _position(entries[0][0]) if entries else None

    def truncate_below(self, position: int) -> None:
        """Forget the requests before `position` (every kept index version includes them)."""
        if self.readonly:
            raise WriteLogError("a read-only write log cannot truncate")
        with _unavailable(self.address):
            self._db.xtrim(self._stream, minid=f"{position}-0", approximate=False)


class LogUnavailable(ShardserveError):
    """The write log's Redis did not answer (down, unreachable, or slower than TIMEOUT_S). Raised by
    an append: nothing was written, unless it is an OutcomeUnknown."""


class OutcomeUnknown(LogUnavailable):
    """An append was sent to Redis and its answer did not come: Redis may have run it (a writer's
    timeout does not stop a script Redis has read). The request may have been written: whoever
    answers it says so, and a client sending it again writes it again (as an upsert or a delete by
    id, the same state)."""


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
