"""The write path without Ray: the router's WriteFront (backpressure, nothing half-written), a shard
replica following the log (ShardWrites), and compaction, whose version answers exactly what the
base plus the log answered at the same log position."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import faiss
import numpy as np
import orjson
import pytest

from deployments.swap import gate_recall
from index_build.compact import compact, prune_versions, truncate_log
from index_build.job import build_index
from serving.evaluate import sharded_search
from shardserve.data.groundtruth import recall_at_k
from shardserve.errors import ApiError, ShardserveError
from shardserve.index.assigner import load_assigner
from shardserve.index.indexes import stored_points
from shardserve.index.manifest import Manifest, read_manifest, read_shard_checked
from shardserve.index.storage import Location
from shardserve.query.filters import check_filter
from shardserve.query.searcher import ShardSearcher
from shardserve.writes.accept import WriteFront
from shardserve.writes.follow import LogGap, ShardWrites
from shardserve.writes.log import WriteLog, log_path
from tests.shared import DIM, ROWS, source_id, write_parquet


@pytest.fixture()
def index(tmp_path: Path) -> Path:
    source = write_parquet(tmp_path / "emb")
    build_index(str(source), 2, "IVF32,Flat", str(tmp_path / "idx"), backend="local", vector_column="emb",
                id_column="doc_id", metadata_columns=["caption"])
    return tmp_path / "idx"


def _replicas(index: Path) -> tuple[Manifest, list[ShardWrites]]:
    """Each shard as a replica serves it: the published version's base plus the log past it."""
    location = Location.parse(str(index))
    manifest = read_manifest(location)
    trained = manifest.trained
    shards = len(manifest.shards)
    return manifest, [ShardWrites(ShardSearcher.load(location, manifest, s, mmap=True), s, shards,
                                  log_path(str(index)), manifest.log_position,
                                  lambda: read_shard_checked(location, trained) if trained else None)
                      for s in range(shards)]


def manifest_folder(manifest: Manifest) -> str:
    """The version directory a published manifest's shards live in."""
    return str(Path(manifest.shards[0].path).parent)


def _body(ids: list[int], vectors: np.ndarray, captions: list[str] | None = None) -> bytes:
    payload: dict = {"ids": ids, "vectors": vectors.tolist()}
    if captions is not None:
        payload["metadata"] = [{"caption": c} for c in captions]
    return orjson.dumps(payload)


def _writes(front: WriteFront, manifest: Manifest, rng: np.random.Generator) -> None:
    """New ids, overwrites of base rows (with new captions), deletes of base rows and of new ids."""
    for round_ in range(30):
        new = [(1 << 50) + 10 * round_ + i for i in range(5)]
        vectors = rng.normal(0, 1, (5, DIM)).astype(np.float32) + rng.integers(0, 6000)
        front.upsert(_body(new, vectors, [f"new {i}" for i in new]), manifest)
        rows = rng.choice(ROWS, 6, replace=False)
        base = [int(i) for i in source_id(rows)]
        front.upsert(_body(base[:3], rng.normal(0, 3, (3, DIM)).astype(np.float32) + 3000,
                           ["moved"] * 3), manifest)
        front.delete(orjson.dumps({"ids": base[3:] + new[:2]}), manifest)


def test_compaction_answers_what_base_plus_log_answered(index: Path) -> None:
    rng = np.random.default_rng(11)
    manifest, before = _replicas(index)
    front = WriteFront(log_path(str(index)))
    _writes(front, manifest, rng)
    queries = rng.normal(0, 2, (40, DIM)).astype(np.float32) + rng.integers(0, 6000, (40, 1))
    queries[:, 0] = rng.integers(0, 6000, 40)
    assigner = load_assigner(str(index))
    where = check_filter({"caption": "moved"}, manifest.dataset.metadata_kinds)
    served = sharded_search(before, queries, 10, {"nprobe": 8}, manifest.metric, assigner)
    filtered = {"nprobe": 8, "filter": where}
    served_moved = sharded_search(before, queries, 10, filtered, manifest.metric, assigner)
    assert all(len(set(ids[ids >= 0].tolist())) == len(ids[ids >= 0]) for ids in served[1])  # once each

    compacted = compact(str(index))
    assert compacted.log_position == WriteLog(log_path(str(index)), readonly=True).last_position() == 90
    assert compacted.build.params["compacted_from"] == manifest.index_version
    new_manifest, after = _replicas(index)
    assert new_manifest.index_version == compacted.index_version and all(r.delta is None for r in after)
    assert all(r.catch_up() == 90 and r.delta is None for r in after)  # nothing past its position
    folded = sharded_search(after, queries, 10, {"nprobe": 8}, manifest.metric, assigner)
    np.testing.assert_array_equal(folded[1], served[1])
    np.testing.assert_allclose(folded[0], served[0], rtol=1e-5)
    folded_moved = sharded_search(after, queries, 10, filtered, manifest.metric, assigner)
    np.testing.assert_array_equal(folded_moved[1], served_moved[1])
    assert (served_moved[1] >= 0).sum() > 0
    # metadata: the overwrites' captions, the deletes gone, in the compacted files
    lookups = [r.lookup([int(i) for i in served_moved[1][0] if i >= 0], ["caption"]) for r in after]
    assert all(row is None or row == {"caption": "moved"} for rows in lookups for row in rows)
    with pytest.raises(ShardserveError, match="nothing to compact"):
        compact(str(index))
    # the log is kept from the oldest version on disk: the build's (position 0) keeps all of it
    log = WriteLog(log_path(str(index)), readonly=True)
    assert log.first_position() == 1
    shutil.rmtree(index / manifest_folder(manifest))  # the build's version, gone
    assert truncate_log(str(index)) == 91 and log.first_position() is None  # all folded in


def test_the_write_backlog_is_bounded_and_a_refusal_writes_nothing(index: Path) -> None:
    manifest = read_manifest(Location.parse(str(index)))
    front = WriteFront(log_path(str(index)), max_backlog=3)
    vectors = np.ones((2, DIM), np.float32)
    assert front.upsert(_body([1, 2], vectors), manifest) == {"position": 1, "upserted": 2}
    with pytest.raises(ApiError) as full:
        front.upsert(_body([3, 4], vectors), manifest)
    assert full.value.status == 503 and full.value.retry_after == 1
    assert front.delete(orjson.dumps({"ids": [1]}), manifest) == {"position": 2, "deleted": 1}  # deletes pass
    with pytest.raises(ApiError) as bad:
        front.upsert(_body([5], np.ones((1, DIM + 1), np.float32)), manifest)
    assert bad.value.status == 422 and bad.value.field == "vectors"
    assert WriteLog(log_path(str(index)), readonly=True).last_position() == 2  # the refused: nowhere
    with pytest.raises(ApiError) as remote:
        WriteFront(None).upsert(_body([1], vectors[:1]), manifest)
    assert remote.value.status == 501


def test_the_backlog_bound_counts_what_another_router_appended(index: Path) -> None:
    """A front counts its own appends without asking the log; once another writer's request lands
    between two of its own, it counts the log again: the bound holds across routers."""
    manifest = read_manifest(Location.parse(str(index)))
    one, two = (WriteFront(log_path(str(index)), max_backlog=4) for _ in range(2))
    vectors = np.ones((2, DIM), np.float32)
    assert one.upsert(_body([1], vectors[:1]), manifest)["position"] == 1
    assert one.upsert(_body([2], vectors[:1]), manifest)["position"] == 2  # counted: its own, 2
    assert two.upsert(_body([3, 4], vectors), manifest)["position"] == 3  # counted from the log: 4
    with pytest.raises(ApiError) as full:  # 2 of its own + 2 of the other's + 1 > 4
        one.upsert(_body([5], vectors[:1]), manifest)
    assert full.value.status == 503 and "backlog full" in full.value.message
    assert WriteLog(log_path(str(index)), readonly=True).last_position() == 3


def test_after_a_swap_to_another_index_writes_go_to_that_index_s_log(index: Path, tmp_path: Path) -> None:
    """The router's front follows the served version: once a swap moves the server onto another
    index directory, a write lands in that index's log (where its shards read), not the first's,
    and the backlog bound counts that log."""
    other = tmp_path / "other"
    shutil.copytree(index, other)
    manifest = read_manifest(Location.parse(str(index)))
    front = WriteFront(log_path(str(index)), max_backlog=3)
    vectors = np.ones((3, DIM), np.float32)
    assert front.upsert(_body([1, 2, 3], vectors), manifest)["position"] == 1  # the first's bound: full
    with pytest.raises(ApiError):
        asyncio.run(front.accept(_body([4], vectors[:1]), True, manifest))
    answer = asyncio.run(front.accept(_body([4], vectors[:1]), True, manifest, log_path(str(other))))
    assert answer == {"position": 1, "upserted": 1}  # the other's log: its first request
    assert WriteLog(log_path(str(index)), readonly=True).last_position() == 1
    assert WriteLog(log_path(str(other)), readonly=True).last_position() == 1
    front.close()


def test_a_replica_applies_nothing_until_written_and_refuses_a_truncated_log(index: Path) -> None:
    manifest, [replica, _] = _replicas(index)
    assert replica.catch_up() == 0 and replica.delta is None  # no log at all: the base alone
    front = WriteFront(log_path(str(index)))
    front.delete(orjson.dumps({"ids": [int(source_id(np.array([0]))[0])]}), manifest)
    assert replica.catch_up() == 1 and replica.delta is not None
    assert replica.live_rows() == int(replica.searcher.index.ntotal) - len(replica.delta.tombstones)
    _, [late, _] = _replicas(index)
    front.delete(orjson.dumps({"ids": [5]}), manifest)
    WriteLog(log_path(str(index))).truncate_below(2)
    with pytest.raises(LogGap, match="starts at request 2"):
        late.catch_up()
    assert replica.catch_up() == 2  # it had request 1 already: the rest is there


def test_the_swap_gate_grades_a_compacted_version_on_its_own_points(index: Path) -> None:
    """The lineage's ground truth knows neither the points writes added nor which rows they deleted:
    the gate of a compacted version computes its truth over the points the version holds."""
    rng = np.random.default_rng(5)
    manifest, _ = _replicas(index)
    front = WriteFront(log_path(str(index)))
    _writes(front, manifest, rng)
    source = str(index.parent / "emb")  # the fixture's parquet data
    queries, lineage, lineage_truth = gate_recall(manifest, source, 20)
    beside = [(1 << 51) + i for i in range(len(queries))]  # a new point right beside each eval query
    front.upsert(_body(beside, queries + 0.01), manifest)
    compacted = compact(str(index))
    graded_queries, live, truth = gate_recall(compacted, source, 20, Location.parse(str(index)))
    np.testing.assert_array_equal(graded_queries, queries)
    assert live.index_ids()[truth[:, 0]].tolist() == beside  # the truth knows the new points
    _, after = _replicas(index)
    found = sharded_search(after, queries, 10, {"nprobe": 32}, manifest.metric,  # every list: exact
                           load_assigner(str(index)))[1]
    assert recall_at_k(found, live, 10, truth) == 1.0
    assert recall_at_k(found, lineage, 10, lineage_truth) < 0.95  # what grading on the lineage gave


@pytest.mark.parametrize("factory", ["IVF4,Flat", "IDMap2,Flat", "IVF4,PQ2x4", "IDMap2,HNSW8"])
def test_stored_points_are_the_added_vectors_or_none(factory: str) -> None:
    """What the gate grades a compacted version on: every (id, vector) as added, for the kinds that
    store vectors as they are; None for codes and graphs."""
    rng = np.random.default_rng(2)
    vectors, ids = rng.random((300, 8), np.float32), np.arange(300, dtype=np.int64) * 7 + 5
    index = faiss.index_factory(8, factory)
    index.train(vectors)
    index.add_with_ids(vectors, ids)
    points = stored_points(faiss.deserialize_index(faiss.serialize_index(index)))
    if factory.endswith("Flat"):
        assert points is not None
        order = np.argsort(points[0])
        np.testing.assert_array_equal(points[0][order], ids)
        np.testing.assert_array_equal(points[1][order], vectors)
    else:
        assert points is None


def test_a_full_backlog_refuses_an_upsert_before_reading_its_body(index: Path) -> None:
    """Once counted full, an upsert gets its 503 on the event loop: not parsed, no thread hand-off
    (the body here is not even JSON). A new version served (another base position) counts again."""
    manifest = read_manifest(Location.parse(str(index)))
    front = WriteFront(log_path(str(index)), max_backlog=3)
    front.upsert(_body([1, 2, 3], np.ones((3, DIM), np.float32)), manifest)  # exactly at the bound
    with pytest.raises(ApiError) as full:
        front.upsert(_body([4], np.ones((1, DIM), np.float32)), manifest)  # counted full
    assert full.value.status == 503
    with pytest.raises(ApiError) as early:
        asyncio.run(front.accept(b"not json", True, manifest))
    assert early.value.status == 503 and "backlog full" in early.value.message
    with pytest.raises(ApiError) as parsed:  # a version at position 1 folded them: room again
        asyncio.run(front.accept(b"not json", True, manifest.model_copy(update={"log_position": 1})))
    assert parsed.value.status == 422


def test_pruning_keeps_the_named_versions_and_one_in_progress_and_truncates_the_log(index: Path) -> None:
    """Automatic compaction keeps the served version and the one before it: older complete versions
    go, a directory without a manifest (a compaction in progress) stays, and the log is cut below
    what the kept versions include."""
    front = WriteFront(log_path(str(index)))
    built = read_manifest(Location.parse(str(index)))
    kept = [built]
    for round_ in range(3):
        front.delete(orjson.dumps({"ids": [int(source_id(np.array([round_]))[0])]}), kept[-1])
        kept.append(compact(str(index)))
    in_progress = index / "versions" / "99991231T000000Z-unfinished"
    in_progress.mkdir()
    gone = prune_versions(str(index), {kept[-1].index_version, kept[-2].index_version})
    assert gone == sorted({manifest_folder(m).split("/")[-1] for m in kept[:2]})
    left = sorted(p.name for p in (index / "versions").iterdir())
    folders = [manifest_folder(m).split("/")[-1] for m in kept[-2:]]
    assert left == sorted([*folders, in_progress.name])
    log = WriteLog(log_path(str(index)), readonly=True)
    assert log.first_position() is None or log.first_position() > kept[-2].log_position
    assert log.last_position() == kept[-1].log_position == 3
    _, replicas = _replicas(index)  # the newest version still serves, from its own files
    assert all(r.catch_up() == 3 for r in replicas)
