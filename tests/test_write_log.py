"""The write log (SQLite, WAL, synchronous=FULL): requests all or nothing, positions monotonic, read
from other processes, and every acknowledged request still there after a SIGKILL. No Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardserve.writes.log import WriteLog
from shardserve.writes.ops import Delete, Op, Upsert, same_ops

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


def test_append_read_truncate(tmp_path: Path) -> None:
    log = WriteLog(tmp_path / "log.sqlite")
    assert log.last_position() == 0 and log.first_position() is None and log.read(0) == []
    positions = [log.append(request(n)) for n in range(1, 8)]
    assert positions == list(range(1, 8))
    read = log.read(0)
    assert [p for p, _ in read] == positions
    assert all(same_ops(ops, request(p)) for p, ops in read)
    assert [p for p, _ in log.read(3, limit=2)] == [4, 5]
    counts = [len(request(n)) for n in range(1, 8)]
    upserts = [sum(isinstance(op, Upsert) for op in request(n)) for n in range(1, 8)]
    assert log.backlog(0) == (7, sum(counts), sum(upserts))
    assert log.backlog(5) == (7, sum(counts[5:]), sum(upserts[5:])) and log.backlog(7) == (7, 0, 0)
    log.truncate_below(6)
    assert log.first_position() == 6 and [p for p, _ in log.read(0)] == [6, 7]
    log.truncate_below(100)  # everything gone: positions still never reused
    assert log.first_position() is None and log.last_position() == 7
    assert log.append(request(8)) == 8
    with pytest.raises(ValueError):
        log.append([])
    log.close()
    again = WriteLog(tmp_path / "log.sqlite")
    assert again.last_position() == 8 and same_ops(again.read(7)[0][1], request(8))


def test_a_failing_request_leaves_nothing(tmp_path: Path) -> None:
    log = WriteLog(tmp_path / "log.sqlite")
    log.append(request(1))
    bad = [*request(2), Upsert(5, np.zeros(DIM, np.float32), {"x": object()})]  # not JSON: fails mid-way
    with pytest.raises(TypeError):
        log.append(bad)
    assert [p for p, _ in log.read(0)] == [1]
    assert log.append(request(3)) > 1


_WRITER = """
import sys
from shardserve.writes.log import WriteLog
from tests.test_write_log import request

log = WriteLog(sys.argv[1])
n = 0
while True:
    n += 1
    position = log.append(request(n))
    assert position == n
    print(position, flush=True)
"""


def test_every_acknowledged_request_survives_a_sigkill(tmp_path: Path) -> None:
    """A child appends requests of 1-5 operations and prints each position once `append` returns
    (its acknowledgement); a reader in this process reads the log while it runs; the child is
    SIGKILLed mid-stream. Reopened, the log holds every acknowledged request with all its
    operations, and no request in part (the one in flight at the kill is whole or absent).

    A process kill leaves the OS page cache alone: this shows atomicity and that the ack comes
    after the commit; synchronous=FULL (checked by WriteLog) is what carries a commit past a power
    cut, which no test here can cut."""
    path = tmp_path / "log.sqlite"
    WriteLog(path).close()  # the schema exists before the reader opens it
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True)
    reader = WriteLog(path, readonly=True)
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
    log = WriteLog(path)
    kept = log.read(0, limit=1_000_000)
    positions = [p for p, _ in kept]
    assert positions == list(range(1, len(positions) + 1))  # no hole
    assert set(acknowledged) <= set(positions)
    assert all(same_ops(ops, request(p)) for p, ops in kept)  # each request whole, none in part
    assert log.append(request(len(positions) + 1)) == len(positions) + 1  # appends go on after it
