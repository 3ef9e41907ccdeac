"""`build --force` into a directory that took writes. The write log belongs to the directory, not to a
version: a rebuild is refused in one line unless told to leave the writes out (`--discard-writes`),
and then its version starts at the log's last position, so its shards start (no LogGap, even after
compaction truncated the log) and replay none of the old writes onto the new data. On both log
engines (the SQLite file; a Redis stream, SHARDSERVE_WRITE_LOG)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from index_build.compact import compact, prune_versions
from index_build.job import build_index
from loadtests.local_cluster import RedisStore
from shardserve.errors import ShardserveError
from shardserve.index.manifest import Manifest, read_manifest, read_shard_checked
from shardserve.index.storage import Location
from shardserve.query.searcher import ShardSearcher
from shardserve.runtime.ports import free_port
from shardserve.writes.follow import ShardWrites
from shardserve.writes.locate import log_address, open_log
from shardserve.writes.ops import Delete, Upsert
from tests.conftest import run_cli

ROWS, DIM, SHARDS = 2000, 8, 2
DATASET = f"synthetic:{ROWS}x{DIM}"


@pytest.fixture(scope="module")
def redis_store() -> Iterator[RedisStore]:
    with RedisStore(port=free_port()) as store:
        yield store


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def index(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A built index whose log (on the engine of the param) took writes, was compacted and truncated
    as automatic compaction leaves it, then took more."""
    for name in ("SHARDSERVE_WRITE_LOG", "SHARDSERVE_WRITE_LOG_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    if request.param == "redis":
        for name, value in request.getfixturevalue("redis_store").write_log_env().items():
            monkeypatch.setenv(name, value)
    build_index(DATASET, SHARDS, "IVF16,Flat", str(tmp_path / "idx"), backend="local")
    index = tmp_path / "idx"
    rng = np.random.default_rng(4)
    log = open_log(log_address(str(index)))  # type: ignore[arg-type]
    try:
        for n in range(5):  # an upsert of a new id, a delete of a base row
            log.append([Upsert(10_000 + n, rng.normal(0, 1, DIM).astype(np.float32)), Delete(n)])
        compacted = compact(str(index))
        prune_versions(str(index), {compacted.index_version})  # the build's version gone: log truncated
        assert log.first_position() is None and log.last_position() == 5
        for n in range(3):
            log.append([Upsert(20_000 + n, rng.normal(0, 1, DIM).astype(np.float32)), Delete(100 + n)])
        assert (log.first_position(), log.last_position()) == (6, 8)
    finally:
        log.close()
    return index


def _replicas(index: Path, manifest: Manifest) -> list[ShardWrites]:
    """Each shard of the published version as a starting replica serves it: its base plus the log."""
    location = Location.parse(str(index))
    trained = manifest.trained

    def empty() -> bytes | None:
        return read_shard_checked(location, trained) if trained else None
    return [ShardWrites(ShardSearcher.load(location, manifest, s), s, SHARDS, log_address(str(index)),
                        manifest.log_position, empty) for s in range(SHARDS)]


def _versions(index: Path) -> list[str]:
    return sorted(p.name for p in (index / "versions").iterdir())


def test_a_rebuild_of_a_directory_that_took_writes_is_refused_or_starts_at_the_log_s_end(index: Path) -> None:
    served, folders = read_manifest(Location.parse(str(index))), _versions(index)
    with pytest.raises(ShardserveError) as refused:
        build_index(DATASET, SHARDS, "IVF16,Flat", str(index), backend="local", force=True)
    assert "\n" not in str(refused.value) and "--discard-writes" in str(refused.value)
    assert "request 8" in str(refused.value)
    assert read_manifest(Location.parse(str(index))) == served and _versions(index) == folders  # untouched

    rebuilt = build_index(DATASET, SHARDS, "IVF16,Flat", str(index), backend="local", force=True,
                          discard_writes=True)
    assert rebuilt.log_position == 8 and rebuilt.build.params["discarded_writes_to"] == 8
    assert read_manifest(Location.parse(str(index))).log_position == 8
    replicas = _replicas(index, rebuilt)
    assert [r.catch_up(required=True) for r in replicas] == [8, 8]  # no LogGap, though 1..5 are gone
    assert all(r.delta is None for r in replicas)  # no old write replayed onto the new data
    assert sum(r.live_rows() for r in replicas) == ROWS  # the dataset's rows, the deleted ones too
    # a write after the rebuild applies to it, and compacts from its position
    log = open_log(log_address(str(index)))  # type: ignore[arg-type]
    try:
        assert log.append([Delete(0)]) == 9
    finally:
        log.close()
    assert [r.catch_up() for r in replicas] == [9, 9] and sum(r.live_rows() for r in replicas) == ROWS - 1
    compacted = compact(str(index))
    assert compacted.build.params["log_from"] == 8 and compacted.num_vectors == ROWS - 1


def test_a_directory_that_never_took_a_write_rebuilds_at_position_0(tmp_path: Path) -> None:
    build_index(DATASET, SHARDS, "Flat", str(tmp_path / "idx"), backend="local")
    rebuilt = build_index(DATASET, SHARDS, "Flat", str(tmp_path / "idx"), backend="local", force=True)
    assert rebuilt.log_position == 0 and "discarded_writes_to" not in rebuilt.build.params


def test_the_cli_refuses_in_one_line_and_builds_with_the_flag(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDSERVE_WRITE_LOG", raising=False)
    index = tmp_path / "idx"
    build_index(DATASET, SHARDS, "Flat", str(index), backend="local")
    log = open_log(log_address(str(index)))  # type: ignore[arg-type]
    try:
        log.append([Delete(3)])
    finally:
        log.close()
    command = ["build", "--dataset", DATASET, "--shards", str(SHARDS), "--index", "Flat", "--out", str(index),
               "--backend", "local", "--force"]
    refused = run_cli(*command)
    assert refused.returncode != 0 and refused.stdout == ""
    assert len(refused.stderr.strip().splitlines()) == 1 and "--discard-writes" in refused.stderr
    built = run_cli(*command, "--discard-writes")
    assert built.returncode == 0, built.stderr
    assert read_manifest(Location.parse(str(index))).log_position == 1
