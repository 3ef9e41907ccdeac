"""A log position names one request, with its epoch, on both engines: a log that lost its newest requests
(a restored SQLite file, a Redis failed over to a replica that was behind, or flushed) never makes a
running shard replica skip the writes acknowledged after the loss; reads and backlogs are bounded
by bytes; the Redis log says when a write's outcome is unknown, and every one of its methods answers
an unreachable Redis with LogUnavailable. Real SQLite files and a real redis-server, no Ray."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import orjson
import pytest
import redis

from index_build.job import build_index
from loadtests.local_cluster import RedisStore
from loadtests.served import wait_for
from shardserve.index.manifest import Manifest, read_manifest, read_shard_checked
from shardserve.index.storage import Location
from shardserve.query.filters import check_filter
from shardserve.query.searcher import ShardSearcher
from shardserve.runtime.ports import free_port
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes import follow, redis_log
from shardserve.writes import log as sqlite_log
from shardserve.writes.follow import LogGap, ShardWrites
from shardserve.writes.locate import Log, LogAddress, open_log
from shardserve.writes.log import WriteLog
from shardserve.writes.ops import Delete, Op, Upsert
from shardserve.writes.redis_log import LogUnavailable, RedisLogAddress, RedisWriteLog
from tests.shared import DIM, write_parquet

NEW = 1 << 50  # ids the tests write: none of them is in the base


def upsert(n: int, caption: str, points: int = 1, meta_bytes: int = 0) -> list[Op]:
    """Request `n`: `points` new ids from NEW + 1000 n, captioned, seeded by n."""
    rng = np.random.default_rng(n)
    return [Upsert(NEW + 1000 * n + i, rng.normal(size=DIM).astype(np.float32),
                   {"caption": caption + "x" * meta_bytes}) for i in range(points)]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Location, Manifest]:
    """One flat shard, built once: every test follows its own log over it."""
    root = tmp_path_factory.mktemp("positions")
    build_index(str(write_parquet(root / "emb")), 1, "Flat", str(root / "idx"), backend="local",
                vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    location = Location.parse(str(root / "idx"))
    return location, read_manifest(location)


@pytest.fixture(scope="module")
def redis_store() -> Iterator[RedisStore]:
    with RedisStore(port=free_port()) as store:
        yield store


@dataclass
class Engine:
    """One log's address, and how a test makes it lose requests: `snapshot()` then, later,
    `restore(snapshot)` puts back what the log held then (every other connection sees it)."""

    address: LogAddress
    snapshot: Callable[[], Any]
    restore: Callable[[Any], None]
    flush: Callable[[], None]

    def writer(self) -> Log:
        return open_log(self.address)


def _sqlite_engine(path: Path) -> Engine:
    """A restored log file: SQLite's backup API copies pages through SQLite's locks, so the open
    connections of the running writer and replicas read the restored file (as after a copy made
    while they were stopped, without stopping them)."""
    copies = iter(range(1_000))

    def snapshot() -> Path:
        copy = path.with_name(f"copy-{next(copies)}.sqlite")
        with sqlite3.connect(path) as live, sqlite3.connect(copy) as aside:
            live.backup(aside)
        return copy

    def restore(copy: Path) -> None:
        with sqlite3.connect(copy) as aside, sqlite3.connect(path) as live:
            aside.backup(live)

    def flush() -> None:
        raise NotImplementedError

    return Engine(path, snapshot, restore, flush)


def _redis_engine(store: RedisStore, address: RedisLogAddress) -> Engine:
    """A Redis that lost requests: the log's keys put back as they were (a failover to a replica
    that was behind), or all of them gone (FLUSHALL)."""
    admin = redis.Redis(host="127.0.0.1", port=store.port, password=store.password)

    def keys() -> list[bytes]:
        return sorted(admin.scan_iter(match=f"{address.prefix}:*"))

    def snapshot() -> dict[bytes, bytes]:
        return {key: admin.dump(key) for key in keys()}  # type: ignore[misc]

    def restore(dumps: dict[bytes, bytes]) -> None:
        for key in keys():
            if key not in dumps:
                admin.delete(key)
        for key, value in dumps.items():
            admin.restore(key, 0, value, replace=True)

    def flush() -> None:
        admin.flushall()

    return Engine(address, snapshot, restore, flush)


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def engine(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Engine:
    if request.param == "sqlite":
        return _sqlite_engine(tmp_path / "log.sqlite")
    store: RedisStore = request.getfixturevalue("redis_store")
    env = store.write_log_env()
    monkeypatch.setenv("SHARDSERVE_WRITE_LOG_PASSWORD_FILE", env["SHARDSERVE_WRITE_LOG_PASSWORD_FILE"])
    return _redis_engine(store, RedisLogAddress.for_index(env["SHARDSERVE_WRITE_LOG"], f"file://{tmp_path}"))


def replica(index: tuple[Location, Manifest], address: LogAddress) -> ShardWrites:
    """A shard replica of the built version, following the log at `address`."""
    location, manifest = index
    trained = manifest.trained
    searcher = ShardSearcher.load(location, manifest, 0, mmap=True)
    return ShardWrites(searcher, 0, 1, address, manifest.log_position,
                       lambda: read_shard_checked(location, trained) if trained else None)


def refused(running: ShardWrites) -> str | None:
    """The LogBehind a catch-up raises now (None: it answered)."""
    try:
        running.catch_up()
    except follow.LogBehind as exc:
        return str(exc)
    return None


def rebuilt(running: ShardWrites) -> int:
    """The position a replica that found its log behind answers at once its view is rebuilt (in a
    thread of its own): every catch-up until then is refused."""
    wait_for(lambda: refused(running) is None, "the view rebuilt", timeout_s=30)
    return running.catch_up()


def same_view(running: ShardWrites, fresh: ShardWrites, requests: int) -> None:
    """Both replicas answer the same metadata for every id the tests wrote, and hold as many rows."""
    ids = [NEW + 1000 * n + i for n in range(1, requests + 1) for i in range(2)]
    assert running.lookup(ids, ["caption"]) == fresh.lookup(ids, ["caption"])
    assert running.live_rows() == fresh.live_rows()


# A: a log that lost requests under a running replica


@pytest.mark.parametrize("appended", [1, 5, 7])  # behind the replica, level with it, past it
@pytest.mark.parametrize("restarted", [False, True])  # the same writer, or one started after the loss
def test_a_running_replica_finds_the_writes_acknowledged_after_the_log_lost_requests(
        engine: Engine, index, appended: int, restarted: bool) -> None:
    """The review's case: requests 6-10 applied by a running replica, then lost by the log; the
    writes acknowledged next are found by the running replica exactly as by one started afterwards
    (and the lost ones are gone from both: the log no longer has them), whether the new writes
    leave the log behind the replica, level with it (the same positions, other requests), or past it."""
    writer = engine.writer()
    for n in range(1, 6):
        writer.append(upsert(n, "kept"))
    before = engine.snapshot()
    for n in range(6, 11):
        writer.append(upsert(n, "lost"))
    running = replica(index, engine.address)
    assert running.catch_up() == 10
    assert running.lookup([NEW + 6000], ["caption"]) == [{"caption": "lost"}]
    engine.restore(before)  # the log holds 1-5 again
    if restarted:  # a router started after the loss: it never saw positions 6-10
        writer.close()
        writer = engine.writer()
    positions = [writer.append(upsert(10 + n, "after")) for n in range(1, appended + 1)]
    assert positions == list(range(6, 6 + appended))
    fresh = replica(index, engine.address)
    assert fresh.catch_up() == positions[-1]
    with pytest.raises(follow.LogBehind, match="no longer holds request 10"):
        running.catch_up()  # not answered from a view that holds writes the log lost
    assert rebuilt(running) == positions[-1]
    assert running.lookup([NEW + 11000, NEW + 6000], ["caption"]) == [{"caption": "after"}, None]
    same_view(running, fresh, 10 + appended)
    writer.append(upsert(30, "later"))  # and it goes on following
    assert running.catch_up() == fresh.catch_up() == positions[-1] + 1
    same_view(running, fresh, 30)
    writer.close()


def test_a_replica_whose_log_no_longer_holds_its_version_s_requests_stops_answering(
        engine: Engine, index) -> None:
    """The log lost requests this replica applied, and no longer holds the requests from its
    version's position on either: it cannot rebuild its view, so it raises LogBehind at each
    catch-up (a 503) rather than answer from what it applied as if it were current."""
    writer = engine.writer()
    for n in range(1, 9):
        writer.append(upsert(n, "kept"))
    before = engine.snapshot()
    running = replica(index, engine.address)
    writer.append(upsert(9, "lost"))
    writer.append(upsert(10, "lost"))
    assert running.catch_up() == 10
    engine.restore(before)
    writer.close()
    writer = engine.writer()
    writer.truncate_below(8)  # the restored log holds request 8 alone
    with pytest.raises(follow.LogBehind, match="no longer holds request 10"):
        running.catch_up()
    wait_for(lambda: "request 1 either" in (refused(running) or ""), "the rebuild refused", timeout_s=30)
    with pytest.raises(follow.LogBehind, match="serve a newer version"):  # and again, each time
        running.catch_up()
    with pytest.raises(follow.LogBehind):
        running.ids_matching(check_filter({"caption": "kept"}, index[1].dataset.metadata_kinds), 10)
    with pytest.raises(LogGap):  # a replica starting on this version could not either
        replica(index, engine.address).catch_up(required=True)
    writer.close()


@pytest.mark.redis
def test_a_running_replica_follows_a_flushed_redis(redis_store: RedisStore, index, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUSHALL takes every request: the writer starts again past the served version's position,
    and the running replica drops what it applied, as one started afterwards has nothing of it."""
    env = redis_store.write_log_env()
    monkeypatch.setenv("SHARDSERVE_WRITE_LOG_PASSWORD_FILE", env["SHARDSERVE_WRITE_LOG_PASSWORD_FILE"])
    engine = _redis_engine(redis_store, RedisLogAddress.for_index(env["SHARDSERVE_WRITE_LOG"],
                                                                   f"file://{tmp_path}"))
    writer = engine.writer()
    for n in range(1, 11):
        writer.append(upsert(n, "flushed"))
    running = replica(index, engine.address)
    assert running.catch_up() == 10
    engine.flush()
    assert [writer.append(upsert(n, "after")) for n in (11, 12)] == [1, 2]
    fresh = replica(index, engine.address)
    assert refused(running) is not None and rebuilt(running) == fresh.catch_up() == 2
    assert running.lookup([NEW + 1000, NEW + 11000], ["caption"]) == [None, {"caption": "after"}]
    same_view(running, fresh, 12)
    writer.close()


def test_a_replica_that_cannot_re_read_the_log_it_found_behind_answers_nothing(
        engine: Engine, index, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss found, then the log unavailable while the replica replays it (a Redis blip): the
    replica goes on refusing (LogBehind) rather than serve what it applied, and rebuilds once the
    log answers again."""
    monkeypatch.setattr(follow, "LOG_DOWN_BACKOFF_S", 0.0)  # a failed rebuild is tried again at once
    writer = engine.writer()
    writer.append(upsert(1, "kept"))
    before = engine.snapshot()
    writer.append(upsert(2, "lost"))
    running = replica(index, engine.address)
    assert running.catch_up() == 2
    engine.restore(before)
    writer.append(upsert(3, "after"))
    log = running._log
    assert log is not None

    def down(*args: object, **kwargs: object) -> object:
        raise LogUnavailable("the log's Redis: down (a fault this test injects)")

    with monkeypatch.context() as fault:
        for read in ("entries", "read"):  # every read of its requests fails
            fault.setattr(log, read, down, raising=False)
        with pytest.raises(follow.LogBehind, match="no longer holds request 2"):
            running.catch_up()
        wait_for(lambda: "a fault this test injects" in (refused(running) or ""), "the rebuild failed",
                 timeout_s=30)
        assert refused(running) is not None
    assert rebuilt(running) == 2
    assert running.lookup([NEW + 2000, NEW + 3000], ["caption"]) == [None, {"caption": "after"}]
    writer.close()


@pytest.mark.redis
def test_a_redis_log_written_before_epochs_is_followed_and_appended_to(
        redis_store: RedisStore, index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream whose entries an older shardserve wrote (no epochs, no byte counts, no tip key):
    read as epoch 0, followed by a replica through the first new request, and its backlog counts
    the new requests' bytes only."""
    env = redis_store.write_log_env()
    monkeypatch.setenv("SHARDSERVE_WRITE_LOG_PASSWORD_FILE", env["SHARDSERVE_WRITE_LOG_PASSWORD_FILE"])
    address = RedisLogAddress.for_index(env["SHARDSERVE_WRITE_LOG"], f"file://{tmp_path}")
    admin = redis.Redis(host="127.0.0.1", port=redis_store.port, password=redis_store.password)
    for n in (1, 2):  # as the older script wrote them
        ops = upsert(n, "old")
        admin.xadd(f"{address.prefix}:requests", {
            "ids": np.array([op.id for op in ops], np.int64).tobytes(), "kinds": bytes([1] * len(ops)),
            "vectors": b"".join(op.vector.tobytes() for op in ops if isinstance(op, Upsert)),
            "metadata": orjson.dumps([op.metadata for op in ops if isinstance(op, Upsert)]),
            "ops_total": n, "upserts_total": n}, id=f"{n}-0")
    admin.set(f"{address.prefix}:seq", 2)
    admin.hset(f"{address.prefix}:totals", mapping={"ops": 2, "upserts": 2})
    running = replica(index, address)
    assert running.catch_up() == 2
    writer = open_log(address)
    new = upsert(3, "new", meta_bytes=10)
    assert writer.append(new) == 3
    assert running.catch_up() == 3
    assert running.lookup([NEW + 1000, NEW + 3000], ["caption"]) == [{"caption": "old"},
                                                                     {"caption": "new" + "x" * 10}]
    assert writer.backlog(0)[:3] == (3, 3, 3) and writer.backlog(0).bytes == _bytes(new)
    assert [(e.position, e.epoch) for e in writer.entries(0)][:2] == [(1, 0), (2, 0)]
    writer.close()
    admin.close()


def test_a_search_with_nothing_new_reads_the_sqlite_log_once(tmp_path: Path, index) -> None:
    """The check that the log still holds what was applied rides in the one statement a search
    already makes: the newest position and the epoch of the request there, together."""
    writer = WriteLog(tmp_path / "log.sqlite")
    writer.append(upsert(1, "one"))
    running = replica(index, tmp_path / "log.sqlite")
    assert running.catch_up() == 1
    statements: list[str] = []
    log = running._log
    assert isinstance(log, WriteLog)
    log._db.set_trace_callback(statements.append)
    assert running.catch_up() == 1
    assert len(statements) == 1, statements


# B: reads and backlogs bounded by bytes


def _bytes(ops: list[Op]) -> int:
    """What a request counts for: its float32 vectors and each point's metadata JSON."""
    return sum(4 * DIM + (0 if op.metadata is None else len(orjson.dumps(op.metadata)))
               for op in ops if isinstance(op, Upsert))


def test_a_read_stops_at_its_byte_budget(engine: Engine) -> None:
    """Requests of 200 points with ~1 KB of metadata each (~200 KB a request): a read takes as many
    as fit in its budget, never fewer than one, and `limit` still bounds it."""
    writer = engine.writer()
    requests = [upsert(n, "big", points=200, meta_bytes=1000) for n in range(1, 7)]
    for ops in requests:
        writer.append(ops)
    size = _bytes(requests[0])
    assert [p for p, _ in writer.read(0, 32, max_bytes=int(2.5 * size))] == [1, 2]
    assert [p for p, _ in writer.read(2, 32, max_bytes=1)] == [3]  # one, whatever its size
    assert [p for p, _ in writer.read(0, 4, max_bytes=100 * size)] == [1, 2, 3, 4]
    assert [p for p, _ in writer.read(3, 32, max_bytes=3 * size)] == [4, 5, 6]  # exactly fits
    light = writer.read(0, 32, vectors=False, max_bytes=int(2.5 * size))
    assert [p for p, _ in light] == [1, 2]
    assert all(isinstance(op, Upsert) and not len(op.vector) for _, ops in light for op in ops)
    assert sqlite_log.READ_BYTES == 32 << 20  # the default: what a replica reads at once
    writer.close()


def test_a_replica_catches_up_through_reads_bounded_by_bytes(engine: Engine, index,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    writer = engine.writer()
    for n in range(1, 6):
        writer.append(upsert(n, "read one by one", points=3))
    monkeypatch.setattr(follow, "READ_BYTES", 1)  # every read takes one request
    running = replica(index, engine.address)
    assert running.catch_up() == 5
    assert running.lookup([NEW + 5002], ["caption"]) == [{"caption": "read one by one"}]
    writer.close()


def test_the_backlog_counts_bytes(engine: Engine) -> None:
    writer = engine.writer()
    requests: list[list[Op]] = [upsert(1, "a", points=3, meta_bytes=100), [Delete(5)],
                [Upsert(NEW, np.ones(DIM, np.float32), None)], upsert(4, "d", points=2)]
    for ops in requests:
        writer.append(ops)
    sizes = [_bytes(ops) for ops in requests]
    assert writer.backlog(0).bytes == sum(sizes)
    assert writer.backlog(1).bytes == sum(sizes[1:]) and writer.backlog(3).bytes == sizes[3]
    assert writer.backlog(4).bytes == 0
    writer.truncate_below(2)  # the first kept: counted from it
    assert writer.backlog(1).bytes == sum(sizes[1:])
    writer.close()


_SCHEMA_V1 = """
CREATE TABLE requests (position INTEGER PRIMARY KEY AUTOINCREMENT, ops INTEGER NOT NULL);
CREATE TABLE ops (position INTEGER NOT NULL, seq INTEGER NOT NULL, id INTEGER NOT NULL, vector BLOB,
                  metadata BLOB, PRIMARY KEY (position, seq)) WITHOUT ROWID;
PRAGMA user_version = 1;
PRAGMA journal_mode = WAL;
"""


def test_a_log_of_schema_1_is_read_then_migrated_when_a_writer_opens_it(tmp_path: Path, index) -> None:
    """An index directory whose log an older shardserve wrote: a reader opened before any writer
    reads it as it is, a writer adds the new columns, and the reader goes on reading past them."""
    path = tmp_path / "log.sqlite"
    old = sqlite3.connect(path, isolation_level=None)
    old.executescript(_SCHEMA_V1)
    for n in (1, 2):  # as the old writer wrote them
        ops = upsert(n, "old", points=2)
        old.execute("INSERT INTO requests (ops) VALUES (?)", (len(ops),))
        old.executemany("INSERT INTO ops VALUES (?, ?, ?, ?, ?)",
                        [(n, s, op.id, op.vector.tobytes(), orjson.dumps(op.metadata))  # type: ignore[union-attr]
                         for s, op in enumerate(ops)])
    old.close()
    running = replica(index, path)
    assert running.catch_up() == 2
    reader = WriteLog(path, readonly=True)
    writer = WriteLog(path)  # migrates
    assert writer.append(upsert(3, "new", points=2)) == 3
    assert [p for p, _ in reader.read(0)] == [1, 2, 3] and running.catch_up() == 3
    assert writer.backlog(0).bytes == sum(_bytes(upsert(n, "old" if n < 3 else "new", points=2))
                                          for n in (1, 2, 3))
    assert [p for p, _ in writer.read(0, max_bytes=1)] == [1]
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == sqlite_log.SCHEMA_VERSION
    writer.close()
    assert WriteLog(path).last_position() == 3  # opened again: nothing to migrate


# C: the Redis log's failures


@pytest.mark.redis
def test_every_redis_log_method_answers_a_stopped_redis_with_log_unavailable(
        redis_store: RedisStore, tmp_path: Path) -> None:
    """A Redis drop during a delete by filter or a compaction's truncation is a 503, not a 500: no
    method lets redis-py's ConnectionError through. An append whose connection could not even be
    made wrote nothing: LogUnavailable, not the outcome-unknown kind."""
    address = RedisLogAddress.for_index(redis_store.write_log_env()["SHARDSERVE_WRITE_LOG"],
                                        f"file://{tmp_path}/stopped")
    log = RedisWriteLog(address, password=redis_store.password)
    log.append(upsert(1, "one"))
    redis_store.kill()
    try:
        calls: list[Callable[[], object]] = [
            log.first_position, lambda: log.truncate_below(1), log.exists, log.last_position,
            lambda: log.read(0), lambda: log.backlog(0)]
        for call in calls:
            with pytest.raises(LogUnavailable):
                call()
        with pytest.raises(LogUnavailable) as refused:
            log.append(upsert(2, "two"))
        assert type(refused.value) is LogUnavailable  # nothing was sent: nothing written
    finally:
        redis_store.start()
    assert [p for p, _ in log.read(0)] == [1] and log.append(upsert(2, "two")) == 2
    log.close()


_BUSY = """
local start = redis.call('TIME')
while true do
  local now = redis.call('TIME')
  if (now[1] - start[1]) * 1000000 + (now[2] - start[2]) > tonumber(ARGV[1]) then return 1 end
end
"""


@pytest.mark.redis
def test_an_append_that_timed_out_after_it_was_sent_says_it_may_have_been_written(
        redis_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis busy (a script of another client runs 2 s) while the writer's append waits: the
    writer's timeout passes after its script was sent, and Redis runs it afterwards. The writer
    raises OutcomeUnknown (its message says the request may have been written), not the
    LogUnavailable that promises nothing was: and the log does hold that request."""
    monkeypatch.setattr(redis_log, "TIMEOUT_S", 0.3)
    address = RedisLogAddress.for_index(redis_store.write_log_env()["SHARDSERVE_WRITE_LOG"],
                                        f"file://{tmp_path}/late")
    log = RedisWriteLog(address, password=redis_store.password)
    assert log.append(upsert(1, "one")) == 1
    admin = redis.Redis(host="127.0.0.1", port=redis_store.port, password=redis_store.password)
    busy = threading.Thread(target=admin.eval, args=(_BUSY, 0, 2_000_000))
    busy.start()
    time.sleep(0.3)  # the busy script runs: Redis reads no other client until it ends
    try:
        with pytest.raises(LogUnavailable) as unknown:
            log.append(upsert(2, "two"))
            pytest.fail("the append was answered: it reached Redis before the busy script")
    finally:
        busy.join()
    assert type(unknown.value).__name__ == "OutcomeUnknown" and "may have been" in str(unknown.value)
    wait_for(lambda: log.last_position() >= 2, "request 2 in the log", timeout_s=5)
    assert [p for p, _ in log.read(0)] == [1, 2]  # the 503 wrote: hence "may have been"
    assert log.append(upsert(3, "three")) == 3
    # the writer moved to a new epoch: had a failover lost request 2 (held under the old one), the
    # next request at position 2 would not pass for it with a replica that applied it
    epochs = [entry.epoch for entry in log.entries(0)]
    assert epochs[0] == epochs[1] != epochs[2], epochs
    log.close()
    admin.close()


def test_a_search_that_finds_its_view_dropped_after_catching_up_answers_log_behind(
        tmp_path: Path, index, monkeypatch: pytest.MonkeyPatch) -> None:
    """The view dropped (the log found behind, by another thread) between a search's catch-up and
    its read of the view, and rebuilt before the search looked again: the search read no view and
    answered from the base alone, a base id deleted by a request the log still holds back in the
    answer. Now it answers LogBehind (a 503), as `lookup` and `ids_matching` do."""
    engine = _sqlite_engine(tmp_path / "log.sqlite")
    writer = engine.writer()
    location, manifest = index
    searcher = ShardSearcher.load(location, manifest, 0, mmap=True)
    base_ids = searcher.index.id_map  # an IndexIDMap2 over a flat index: its ids in row order
    doomed = int(faiss.vector_to_array(base_ids)[3])
    writer.append([Delete(doomed)])
    running = replica(index, engine.address)
    assert running.catch_up() == 1
    query = ShardQuery(searcher._vectors(np.array([doomed]))[None, 0], 5, {})
    assert doomed not in running.answer(query)[1][0].tolist()
    def dropped_after(catch_up: Callable[..., int]) -> Callable[..., int]:
        def caught_up(*args: object) -> int:
            position = catch_up(*args)
            running._resets += 1  # what _behind does; the search then reads the view mid-drop
            running._view = None
            return position
        return caught_up

    monkeypatch.setattr(running, "catch_up", dropped_after(running.catch_up))
    monkeypatch.setattr(running, "_catch_up", dropped_after(running._catch_up))
    for call in (lambda: running.answer(query), lambda: running.lookup([doomed], ["caption"]),
                 lambda: running.ids_matching(check_filter({"caption": "x"}, manifest.dataset.metadata_kinds),
                                              10)):
        with pytest.raises(follow.LogBehind):
            call()
    writer.close()


# D: a traced write's trace context, kept with it for the replicas

TRACED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_traced_writes_traceparent_is_kept_with_it_and_told_to_the_replica(engine: Engine, index) -> None:
    """The log keeps a traced request's `traceparent` (an untraced one keeps none), and a replica
    tells `on_applied` exactly the traced requests of each read it applied, with the read's times."""
    writer = engine.writer()
    running = replica(index, engine.address)
    told: list[tuple[list[int], float, float]] = []
    running.on_applied = lambda entries, start, end: told.append(([e.position for e in entries], start, end))
    before = time.time()
    assert writer.append(upsert(1, "a"), trace=TRACED) == 1
    assert writer.append(upsert(2, "b")) == 2
    assert writer.append([Delete(NEW + 1000)], trace=TRACED) == 3
    assert [(e.position, e.trace) for e in writer.entries(0)] == [(1, TRACED), (2, None), (3, TRACED)]
    assert running.catch_up() == 3
    ((positions, start, end),) = told
    assert positions == [1, 3] and before <= start <= end <= time.time()
    assert writer.append(upsert(4, "c")) == 4 and running.catch_up() == 4
    assert len(told) == 1  # a read with no traced request: nothing told
    writer.close()


def test_a_log_of_schema_2_keeps_its_epochs_for_a_reader_and_gains_traces_when_a_writer_opens_it(
        tmp_path: Path) -> None:
    """A log an earlier shardserve wrote (schema 2: epochs, no trace column): a reader opened before
    any new writer reads its epochs as they are and no trace; a writer adds the column, and the
    reader then reads traces too."""
    path = tmp_path / "log.sqlite"
    first = WriteLog(path)
    assert first.append(upsert(1, "old")) == 1
    first.close()
    with sqlite3.connect(path) as old:
        old.execute("ALTER TABLE requests DROP COLUMN trace")
        old.execute("PRAGMA user_version = 2")
    reader = WriteLog(path, readonly=True)
    (entry,) = reader.entries(0)
    assert entry.epoch != 0 and entry.trace is None and reader.tip().epoch == entry.epoch
    writer = WriteLog(path)  # migrates to the current schema
    assert writer.append(upsert(2, "new"), trace=TRACED) == 2
    assert [(e.position, e.trace) for e in reader.entries(0)] == [(1, None), (2, TRACED)]
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == sqlite_log.SCHEMA_VERSION
    writer.close()
    reader.close()
