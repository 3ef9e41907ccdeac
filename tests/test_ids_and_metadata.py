"""The user's own int64 ids from a parquet column: stored in the index, returned in answers, graded
right by eval; duplicates, negatives, a missing or non-integer column refused with one line.
Real parquet files, real FAISS; the local build backend (the Ray backend is the same adds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from index_build.job import build_index
from serving.evaluate import evaluate
from shardserve.data.datasets import load_dataset
from shardserve.errors import ShardserveError
from shardserve.query.searcher import load_all_shards
from tests.conftest import SERVE_PORT, run_cli
from tests.shared import ROWS, source_id, write_parquet


def test_ids_follow_their_rows_and_every_row_is_in_the_base(tmp_path: Path) -> None:
    data = load_dataset(str(write_parquet(tmp_path / "emb")), vector_column="emb", id_column="doc_id")
    assert len(data.base) == ROWS  # eval's queries are some of those rows, not rows taken out
    np.testing.assert_array_equal(data.ids, source_id(np.arange(ROWS)))
    np.testing.assert_array_equal(data.queries, data.base[data.query_rows])
    rows = np.array([[5, 0, -1], [len(data.base) - 1, 2, 3]])
    np.testing.assert_array_equal(data.rows_of(np.where(rows >= 0, data.ids[rows], -1)), rows)
    assert data.rows_of(np.array([12345]))[0] == -1  # an id the dataset does not have
    # A glob of the same files is the same dataset.
    same = load_dataset(str(tmp_path / "emb" / "part-*.parquet"), vector_column="emb", id_column="doc_id")
    assert same.fingerprint() == data.fingerprint()
    assert load_dataset(str(tmp_path / "emb")).fingerprint() != data.fingerprint()  # no ids: row numbers


def test_answers_carry_the_users_ids_and_eval_grades_them(tmp_path: Path) -> None:
    source = write_parquet(tmp_path / "emb")
    with_ids = build_index(str(source), 2, "IVF32,Flat", str(tmp_path / "ids"), backend="local",
                           vector_column="emb", id_column="doc_id")
    plain = build_index(str(source), 2, "IVF32,Flat", str(tmp_path / "rows"), backend="local",
                        vector_column="emb")
    assert with_ids.dataset.id_column == "doc_id" and plain.dataset.id_column is None
    data = load_dataset(str(source), vector_column="emb", id_column="doc_id")
    _, searchers = load_all_shards(str(tmp_path / "ids"))
    found = np.concatenate([s.search(data.queries[:20], 5, {"nprobe": 32})[1] for s in searchers], axis=1)
    # Only the user's ids come back (-1 pads a shard's answer: it owns only some IVF lists).
    assert set(found.ravel().tolist()) - {-1} <= set(data.ids.tolist()) and (found >= 0).any()
    # Same data, same training: the same neighbours, named by id in one index and by row in the other.
    graded = evaluate(str(tmp_path / "ids"), str(source), k=10, params={"nprobe": 8})
    by_row = evaluate(str(tmp_path / "rows"), str(source), k=10, params={"nprobe": 8})
    assert graded["recall"] == by_row["recall"] > 0.8


@pytest.mark.parametrize("ids, id_type, message", [
    (np.where(np.arange(ROWS) == 77, source_id(np.array(5)), source_id(np.arange(ROWS))), pa.int64(),
     "duplicate ids"),
    (np.where(np.arange(ROWS) == 9, -4, source_id(np.arange(ROWS))), pa.int64(), "ids must be >= 0"),
    (source_id(np.arange(ROWS)), pa.float64(), "expected integers"),
])
def test_bad_ids_are_refused_in_one_line(tmp_path: Path, ids, id_type, message: str) -> None:
    source = write_parquet(tmp_path / "emb", ids, id_type)
    with pytest.raises(ShardserveError, match=message):
        load_dataset(str(source), id_column="doc_id")
    result = run_cli("build", "--dataset", str(source), "--id-column", "doc_id", "--shards", "2",
                     "--index", "Flat", "--out", str(tmp_path / "out"), "--backend", "local")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("shardserve: error:")
    assert message in result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_missing_columns_are_refused(tmp_path: Path) -> None:
    source = write_parquet(tmp_path / "emb")
    with pytest.raises(ShardserveError, match="no column 'nope'"):
        load_dataset(str(source), id_column="nope")
    with pytest.raises(ShardserveError, match="no column 'vec'"):
        load_dataset(str(source), vector_column="vec")
    with pytest.raises(ShardserveError, match="apply to parquet"):
        load_dataset("synthetic:100x4", id_column="doc_id")
    with pytest.raises(ShardserveError, match="no parquet files"):
        load_dataset(str(tmp_path / "none-*.parquet"))


def _source_row(ids: np.ndarray) -> np.ndarray:
    return (np.asarray(ids) - 2**40) // 1_000_003


def test_metadata_is_stored_per_shard_and_found_by_id(tmp_path: Path) -> None:
    from shardserve.index.manifest import read_manifest
    from shardserve.index.metadata import MetadataTable, combine
    from shardserve.index.storage import Location

    source = write_parquet(tmp_path / "emb")
    manifest = build_index(str(source), 3, "IVF32,Flat", str(tmp_path / "idx"), backend="local",
                           vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    assert manifest.dataset.metadata_columns == ["caption"] and len(manifest.metadata) == 3
    location = Location.parse(str(tmp_path / "idx"))
    assert read_manifest(location).index_version == manifest.index_version
    data = load_dataset(str(source), vector_column="emb", id_column="doc_id")
    tables = [MetadataTable.load(location, entry) for entry in manifest.metadata]
    wanted = [int(i) for i in data.ids[::97]] + [123]  # ... and an id no shard has
    found = combine([table.lookup(wanted, ["caption"]) for table in tables], len(wanted))
    assert found[-1] is None
    assert [row["caption"] for row in found[:-1]] == [f"caption {r}" for r in _source_row(wanted[:-1])]
    # Each id is in exactly one shard's table: the shard whose index holds it.
    _, searchers = load_all_shards(str(tmp_path / "idx"))
    for searcher, table in zip(searchers, tables, strict=True):
        _, ids = searcher.search(data.queries[:5], 3, {"nprobe": 32})[:2]  # every list this shard owns
        held = [i for i in ids.ravel().tolist() if i >= 0]
        assert held and all(row is not None for row in table.lookup(held, ["caption"]))


@pytest.mark.parametrize("columns, message", [
    (["nope"], "no metadata column 'nope'"),
    (["doc_id"], "ids are returned as `ids` already"),
    (["emb"], "only strings, numbers and booleans"),
])
def test_bad_metadata_columns_are_refused(tmp_path: Path, columns: list[str], message: str) -> None:
    with pytest.raises(ShardserveError, match=message):
        load_dataset(str(write_parquet(tmp_path / "emb")), vector_column="emb", id_column="doc_id",
                     metadata_columns=columns)


@pytest.mark.slow
def test_include_returns_each_hits_metadata_over_http(ray_cluster, tmp_path: Path) -> None:
    """Real Serve: `include` adds the right caption for every hit (checked against the parquet
    source), per result for batches; an unknown column is a 422 naming `include`."""
    import httpx

    from deployments.run import deploy, undeploy

    source = write_parquet(tmp_path / "emb")
    build_index(str(source), 2, "IVF32,Flat", str(tmp_path / "idx"), backend="local",
                vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    data = load_dataset(str(source), vector_column="emb", id_column="doc_id")
    url = deploy(str(tmp_path / "idx"), port=SERVE_PORT, app_name="meta", route_prefix="/meta",
                 shard_num_cpus=0.1, router_num_cpus=0.1)
    try:
        single = httpx.post(f"{url}/v1/search", json={"vector": data.queries[0].tolist(), "k": 5,
                                                      "include": ["caption"]}, timeout=30).json()
        batch = httpx.post(f"{url}/v1/search", json={"vectors": data.queries[1:4].tolist(), "k": 4,
                                                     "include": ["caption"]}, timeout=30).json()
        plain = httpx.post(f"{url}/v1/search", json={"vector": data.queries[0].tolist(), "k": 5},
                           timeout=30).json()
        bad = httpx.post(f"{url}/v1/search", json={"vector": data.queries[0].tolist(),
                                                   "include": ["url"]}, timeout=30)
    finally:
        undeploy("meta")
    for answer in [single, *batch["results"]]:
        assert answer["ids"] and set(answer["ids"]) <= set(data.ids.tolist())
        assert answer["metadata"] == [{"caption": f"caption {r}"} for r in _source_row(answer["ids"])]
    assert plain["ids"] == single["ids"] and "metadata" not in plain
    assert bad.status_code == 422 and bad.json()["field"] == "include"


@pytest.mark.slow
def test_an_int64_filter_past_2_53_is_exact_over_http(ray_cluster, tmp_path: Path) -> None:
    """A parquet column holding 2^60 + (row mod 500), served: equality, $in, ranges and $and return
    exactly the matching rows (k larger than the matches); a value outside int64 is a 422 naming
    `filter`. Before, numbers were compared as float64 and 2^60 + 1 matched 2^60's rows."""
    import httpx

    from deployments.run import deploy, undeploy

    big = 2**60
    source = write_parquet(tmp_path / "emb")
    for part in sorted(source.glob("*.parquet")):
        table = pq.read_table(part)
        rows = _source_row(table.column("doc_id").to_numpy())
        pq.write_table(table.append_column("big", pa.array((big + rows % 500).tolist(), pa.int64())), part)
    build_index(str(source), 2, "IVF32,Flat", str(tmp_path / "idx"), backend="local",
                vector_column="emb", id_column="doc_id", metadata_columns=["big"])
    data = load_dataset(str(source), vector_column="emb", id_column="doc_id")
    url = deploy(str(tmp_path / "idx"), port=SERVE_PORT, app_name="big", route_prefix="/big",
                 shard_num_cpus=0.1, router_num_cpus=0.1)
    cases = [({"big": big + 1}, {1}), ({"big": {"$in": [big + 7, big + 3]}}, {3, 7}),
             ({"big": {"$gt": big + 497}}, {498, 499}), ({"big": {"$gte": big + 498}}, {498, 499}),
             ({"big": {"$lt": big + 1}}, {0}),
             ({"$and": [{"big": {"$gte": big + 10}}, {"big": {"$lt": big + 12}}]}, {10, 11})]
    try:
        answers = [httpx.post(f"{url}/v1/search", json={"vector": data.queries[0].tolist(), "k": 50,
                                                        "filter": where}, timeout=30) for where, _ in cases]
        refused = [httpx.post(f"{url}/v1/search", json={"vector": data.queries[0].tolist(),
                                                        "filter": {"big": v}}, timeout=30)
                   for v in (2**63, 2**64 - 1, -(2**63) - 1)]
    finally:
        undeploy("big")
    for (where, wanted), answer in zip(cases, answers, strict=True):
        assert answer.status_code == 200, answer.text
        expected = sorted(r for r in range(ROWS) if r % 500 in wanted)
        assert sorted(_source_row(answer.json()["ids"]).tolist()) == expected, where
        assert answer.json()["matched"] == len(expected)
    assert all(r.status_code == 422 and r.json()["field"] == "filter" for r in refused)


def test_every_row_of_a_60k_parquet_is_indexed_and_finds_itself(tmp_path: Path) -> None:
    """60,000 rows in, 60,000 vectors served: each row's own vector finds its own id (IVF with
    nprobe 1 probes the list the row was added to, its nearest centroid)."""
    import pyarrow as pa

    from serving.evaluate import sharded_search
    from shardserve.index.assigner import load_assigner

    rows, rng = 60_000, np.random.default_rng(60)
    vectors = rng.normal(size=(rows, 16)).astype(np.float32)
    ids = rng.permutation(10 * rows)[:rows].astype(np.int64) + 7  # the user's own, in no order
    (tmp_path / "emb").mkdir()
    for number, part in enumerate(np.array_split(np.arange(rows), 3)):
        pq.write_table(pa.table({"emb": pa.array(list(vectors[part]), type=pa.list_(pa.float32())),
                                 "doc_id": ids[part]}), tmp_path / "emb" / f"part-{number}.parquet")
    manifest = build_index(str(tmp_path / "emb"), 3, "IVF256,Flat", str(tmp_path / "idx"), backend="local",
                           vector_column="emb", id_column="doc_id")
    assert manifest.num_vectors == rows and sum(s.num_vectors for s in manifest.shards) == rows
    _, searchers = load_all_shards(str(tmp_path / "idx"))
    assigner = load_assigner(str(tmp_path / "idx"))
    found = sharded_search(searchers, vectors, 1, {"nprobe": 1}, "l2", assigner)[1]
    np.testing.assert_array_equal(found[:, 0], ids)
