"""The write log, on both engines (SQLite in WAL mode with synchronous=FULL; a Redis stream on
Debian's redis-server with appendfsync always): requests all or nothing, positions monotonic, read
from other processes, and every acknowledged request still there after a SIGKILL of the writer,
and of Redis itself. No Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from loadtests.local_cluster import RedisStore
from shardserve.runtime.ports import free_port
from shardserve.writes.locate import log_address, open_log
from shardserve.writes.log import LogMoved
from shardserve.writes.ops import Delete, Op, Upsert, same_ops
from shardserve.writes.redis_log import RedisLogAddress, RedisWriteLog

ROOT = Path(__file__).resolve().parent.parent
DIM = 8


def request(position: int) -> list[Op]:
    """The request a writer sends as its `position`-th: 1 to 5 operations, seeded by it."""
    rng = np.random.default_rng(position)
    ops: list[Op] = []
    for seq in range(1 + position % 5):
        point = position * 10 + seq
        if seq % 3 == 2:
            ops.append(Delete(point - 1))
        else:
            meta = None if seq % 2 else {"label": int(rng.integers(0, 9)), "big": 2**63 - position}
            ops.append(Upsert(point, rng.random(DIM, dtype=np.float32), meta))
    return ops


@pytest.fixture(scope="module")
def redis_store():
    with RedisStore(port=free_port()) as store:
        yield store


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def engine(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The environment that picks one engine for an index at tmp_path/idx: log_address resolves it."""
    env = {}
    if request.param == "redis":
        env = request.getfixturevalue("redis_store").write_log_env()
    for name in ("SHARDSERVE_WRITE_LOG", "SHARDSERVE_WRITE_LOG_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "idx").mkdir()
    address = log_address(str(tmp_path / "idx"))
    assert isinstance(address, RedisLogAddress) == (request.param == "redis")
    return address, env


def test_append_read_truncate(engine) -> None:
    address, _ = engine
    log = open_log(address)
    assert log.last_position() == 0 and log.first_position() is None and log.read(0) == []
    positions = [log.append(request(n)) for n in range(1, 8)]
    assert positions == list(range(1, 8))
    read = log.read(0)
    assert [p for p, _ in read] == positions
    assert all(same_ops(ops, request(p)) for p, ops in read)
    assert [p for p, _ in log.read(3, limit=2)] == [4, 5]
    counts = [len(request(n)) for n in range(1, 8)]
    upserts = [sum(isinstance(op, Upsert) for op in request(n)) for n in range(1, 8)]
    assert log.backlog(0)[:3] == (7, sum(counts), sum(upserts))  # bytes: tests/test_log_positions.py
    assert log.backlog(5)[:3] == (7, sum(counts[5:]), sum(upserts[5:])) and log.backlog(7)[:3] == (7, 0, 0)
    log.truncate_below(6)
    assert log.first_position() == 6 and [p for p, _ in log.read(0)] == [6, 7]
    log.truncate_below(100)  # everything gone: positions still never reused
    assert log.first_position() is None and log.last_position() == 7
    assert log.append(request(8)) == 8
    with pytest.raises(ValueError):
        log.append([])
    assert log.backlog(7)[:3] == (8, len(request(8)), sum(isinstance(op, Upsert) for op in request(8)))
    log.close()
    again = open_log(address)
    assert again.last_position() == 8 and same_ops(again.read(7)[0][1], request(8))


def test_a_conditional_append_writes_only_onto_the_position_it_names(engine) -> None:
    log = open_log(engine[0])
    assert log.append(request(1)) == 1
    assert log.append(request(2), unless_past=1) == 2  # the log was at 1: written
    with pytest.raises(LogMoved):
        log.append(request(3), unless_past=1)  # the log is at 2 now: nothing written
    assert log.last_position() == 2 and [p for p, _ in log.read(0)] == [1, 2]
    assert log.append(request(3), after=10, unless_past=2) == 11  # past the served version, as any append
    log.close()


def test_a_failing_request_leaves_nothing(engine) -> None:
    log = open_log(engine[0])
    log.append(request(1))
    bad = [*request(2), Upsert(5, np.zeros(DIM, np.float32), {"x": object()})]  # not JSON: fails mid-way
    with pytest.raises(TypeError):
        log.append(bad)
    assert [p for p, _ in log.read(0)] == [1]
    assert log.append(request(3)) > 1


_WRITER = """
import sys
from shardserve.writes.locate import log_address, open_log
from tests.test_write_log import request

log = open_log(log_address(sys.argv[1]))
n = 0
while True:
    n += 1
    position = log.append(request(n))
    assert position == n
    print(position, flush=True)
"""


def test_every_acknowledged_request_survives_a_sigkill(engine, tmp_path: Path) -> None:
    """A child appends requests of 1-5 operations and prints each position once `append` returns
    (its acknowledgement); a reader in this process reads the log while it runs; the child is
    SIGKILLed mid-stream. Reopened, the log holds every acknowledged request with all its
    operations, and no request in part (the one in flight at the kill is whole or absent).

    A process kill leaves the OS page cache alone: this shows atomicity and that the ack comes
    after the commit; synchronous=FULL (checked by WriteLog) is what carries a commit past a power
    cut, which no test here can cut."""
    address, env = engine
    open_log(address).close()  # the schema exists before the reader opens it
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "idx")], stdout=subprocess.PIPE,
                             env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, text=True)
    reader = open_log(address, readonly=True)
    acknowledged: list[int] = []
    seen_while_running = 0
    assert child.stdout is not None
    try:
        deadline = time.monotonic() + 60
        while len(acknowledged) < 300 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            acknowledged.append(int(line))
            if len(acknowledged) % 50 == 0:  # another process reads committed requests, whole
                read = reader.read(seen_while_running, limit=10_000)
                assert all(same_ops(ops, request(p)) for p, ops in read)
                assert read and read[-1][0] >= acknowledged[-1]  # at least what was acknowledged
                seen_while_running = read[-1][0]
        os.kill(child.pid, signal.SIGKILL)  # mid-stream: it was appending as fast as it could
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert len(acknowledged) == 300 and acknowledged == list(range(1, 301))
    reader.close()
    log = open_log(address)
    kept = log.read(0, limit=1_000_000)
    positions = [p for p, _ in kept]
    assert positions == list(range(1, len(positions) + 1))  # no hole
    assert set(acknowledged) <= set(positions)
    assert all(same_ops(ops, request(p)) for p, ops in kept)  # each request whole, none in part
    assert log.append(request(len(positions) + 1)) == len(positions) + 1  # appends go on after it


@pytest.mark.redis
def test_an_acknowledged_request_survives_a_sigkill_of_redis_itself(redis_store, tmp_path: Path) -> None:
    """Appends acknowledged by a Redis that runs with appendfsync always, then redis-server
    SIGKILLed and started again on its files: every acknowledged request is there, whole, and
    positions go on from the last one."""
    address = RedisLogAddress.for_index(redis_store.write_log_env()["SHARDSERVE_WRITE_LOG"],
                                        f"file://{tmp_path}/kill-redis")
    log = RedisWriteLog(address, password=redis_store.password)
    acknowledged = [log.append(request(n)) for n in range(1, 201)]
    log.close()
    redis_store.kill()
    redis_store.start()
    log = RedisWriteLog(address, password=redis_store.password)
    kept = log.read(0, limit=1_000)
    assert [p for p, _ in kept] == acknowledged == list(range(1, 201))
    assert all(same_ops(ops, request(p)) for p, ops in kept)
    assert log.append(request(201)) == 201


@pytest.mark.redis
def test_a_redis_that_would_lose_an_acknowledged_write_is_refused(redis_store, tmp_path: Path) -> None:
    """A writer checks appendonly and appendfsync: a 200 must outlive Redis's loss."""
    address = RedisLogAddress.for_index(redis_store.write_log_env()["SHARDSERVE_WRITE_LOG"],
                                        f"file://{tmp_path}/lax")
    admin = RedisWriteLog(address, readonly=True, password=redis_store.password)
    admin._db.config_set("appendfsync", "everysec")
    try:
        with pytest.raises(RuntimeError, match="appendfsync.: .everysec"):
            RedisWriteLog(address, password=redis_store.password)
        RedisWriteLog(address, readonly=True, password=redis_store.password).close()  # readers may
    finally:
        admin._db.config_set("appendfsync", "always")
        admin.close()


def test_a_redis_url_never_carries_the_password() -> None:
    with pytest.raises(ValueError, match="password"):
        RedisLogAddress.for_index("redis://:secret@127.0.0.1:6379/0", "file:///idx")
    with pytest.raises(ValueError, match="redis://"):
        RedisLogAddress.for_index("http://127.0.0.1:6379", "file:///idx")


def test_a_redis_url_with_a_password_or_options_is_refused_without_showing_them() -> None:
    for url in ("redis://:hunter2secret@127.0.0.1:6379/0", "redis://u:hunter2secret@127.0.0.1:6379",
                "redis://127.0.0.1:6379/0?password=hunter2secret", "redis://127.0.0.1:6379/0#hunter2secret"):
        with pytest.raises(ValueError) as refused:
            RedisLogAddress.for_index(url, "file:///idx")
        assert "hunter2secret" not in str(refused.value) and "redis://HOST:PORT" in str(refused.value)
    assert RedisLogAddress.for_index("redis://127.0.0.1:6379/3", "file:///idx").prefix.endswith("}")


def test_positions_always_pass_the_served_version_s(engine) -> None:
    """A log that lost its newest requests (restored, flushed, or new beside a compacted index)
    never hands out a position at or below the served version's: replicas would skip it."""
    log = open_log(engine[0])
    assert log.append(request(1), after=40) == 41
    assert log.append(request(2)) == 42 and log.last_position() == 42
    log.close()


@pytest.mark.redis
def test_a_redis_log_whose_counter_was_lost_goes_on_past_its_newest_request(redis_store,
                                                                            tmp_path: Path) -> None:
    address = RedisLogAddress.for_index(redis_store.write_log_env()["SHARDSERVE_WRITE_LOG"],
                                        f"file://{tmp_path}/lost-counter")
    log = RedisWriteLog(address, password=redis_store.password)
    assert [log.append(request(n)) for n in range(1, 4)] == [1, 2, 3]
    log._db.delete(f"{address.prefix}:seq")  # a counter lost (an eviction, a partial restore)
    assert log.append(request(4)) == 4 and [p for p, _ in log.read(0)] == [1, 2, 3, 4]
    log.close()


def test_a_log_whose_redis_is_down_refuses_writes_with_a_503_and_followers_serve_what_they_applied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens at the address: a writer does not open (LogUnavailable, no retries: a resent
    append could be a second request), the router's front answers 503 + Retry-After, a search's
    catch-up serves the position applied, and a starting replica's catch-up raises."""
    from shardserve.query.api import ApiError
    from shardserve.writes.accept import WriteFront
    from shardserve.writes.follow import ShardWrites
    from shardserve.writes.redis_log import LogUnavailable

    monkeypatch.delenv("SHARDSERVE_WRITE_LOG_PASSWORD_FILE", raising=False)
    address = RedisLogAddress.for_index(f"redis://127.0.0.1:{free_port()}/0", "file:///down")
    with pytest.raises(LogUnavailable):
        RedisWriteLog(address)
    with pytest.raises(ApiError) as refused:
        WriteFront(address).delete(b'{"ids": [1]}', _Manifest())  # type: ignore[arg-type]
    assert refused.value.status == 503 and refused.value.retry_after == 1
    follower = ShardWrites(None, 0, 1, address, 7, lambda: None)  # type: ignore[arg-type]
    assert follower.catch_up() == 7
    with pytest.raises(LogUnavailable):
        follower.catch_up(required=True)


class _Manifest:
    log_position, index_factory, dim, metric = 0, "IVF8,Flat", 4, "l2"


def test_requests_appended_together_are_all_there_or_none(tmp_path: Path) -> None:
    """SQLite's group commit (WriteFront's): consecutive positions, each request whole; one that
    fails inside the transaction leaves nothing of the group."""
    log = open_log(tmp_path / "log.sqlite")
    assert log.append_many([request(1), request(2), request(3)], after=4) == [5, 6, 7]
    assert [(p, len(ops)) for p, ops in log.read(0)] == [(5, len(request(1))), (6, len(request(2))),
                                                          (7, len(request(3)))]
    with pytest.raises(OverflowError):  # SQLite refuses the id inside the transaction: rolled back
        log.append_many([request(4), [Delete(2**63)]])
    with pytest.raises(ValueError):
        log.append_many([request(4), []])
    assert log.last_position() == 7 and log.append(request(4)) == 8


KILLS = 8  # of the group-commit writer


def group_size(position: int) -> int:
    """The requests a group-commit writer appends together after `position`: 1 to 8, seeded by it."""
    return 1 + position * 7919 % 8


_GROUP_WRITER = """
import sys
from shardserve.writes.log import WriteLog
from tests.test_write_log import group_size, request

log = WriteLog(sys.argv[1])
n = log.last_position()  # a group's end, if the last kill left every group whole or absent
while True:
    size = group_size(n)
    assert log.append_many([request(n + 1 + i) for i in range(size)]) == list(range(n + 1, n + 1 + size))
    n += size
    print(n, flush=True)
"""


def test_a_group_commit_survives_sigkills_whole_or_not_at_all(tmp_path: Path) -> None:
    """A child appends groups of 1-8 requests in one transaction each (the router's group commit)
    as fast as it can, printing the newest position once `append_many` returns (the group's
    acknowledgement), and is SIGKILLed mid-stream; started again on the same file, KILLS times.
    After each kill the log holds every acknowledged request, each whole, and ends at a group's
    end: the group in flight at the kill is all there or not at all."""
    path = tmp_path / "log.sqlite"
    open_log(path).close()
    ends, end = {0}, 0
    while end < 1_000_000:
        end += group_size(end)
        ends.add(end)
    acknowledged, rng = 0, np.random.default_rng(7)
    for _ in range(KILLS):
        child = subprocess.Popen([sys.executable, "-c", _GROUP_WRITER, str(path)], stdout=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
        assert child.stdout is not None
        try:
            start, deadline = acknowledged, time.monotonic() + 60
            while acknowledged < start + 200 and time.monotonic() < deadline:
                line = child.stdout.readline()
                if not line:
                    break
                acknowledged = int(line)
            # not right after a line (a group's end): at a random point of the groups that follow
            time.sleep(float(rng.uniform(0.0, 0.02)))
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        for line in child.stdout.read().split():  # acknowledged before the kill, read after it
            acknowledged = int(line)
        assert child.returncode == -signal.SIGKILL and acknowledged >= start + 200
        log = open_log(path, readonly=True)
        kept = log.read(0, limit=1_000_000)
        log.close()
        positions = [p for p, _ in kept]
        assert positions == list(range(1, len(positions) + 1))  # no hole
        assert len(positions) >= acknowledged and len(positions) in ends
        assert all(same_ops(ops, request(p)) for p, ops in kept)  # each request whole
        acknowledged = len(positions)  # the next child goes on from there
