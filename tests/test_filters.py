"""Metadata filters (Chroma's `where`): checked in the router (422 naming `filter`), evaluated per
shard into a FAISS selector, planned by selectivity. Real FAISS, real parquet, no Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from index_build.job import build_index
from serving.evaluate import sharded_search
from shardserve.data.datasets import load_dataset
from shardserve.index.assigner import load_assigner
from shardserve.index.metadata import POSTING_VALUES, Postings, build_postings, column_kinds
from shardserve.query.api import ApiError
from shardserve.query.filters import MAX_DEPTH, MAX_IN, check_filter, matching
from shardserve.query.searcher import load_all_shards
from tests.shared import ROWS, source_id, write_parquet

TABLE = pa.table({"label": pa.array(np.arange(12) % 3, pa.uint8()), "lang": pa.array(list("abcd") * 3),
                  "ok": pa.array([True, False] * 6)})
KINDS = column_kinds(TABLE.schema)
IDS = np.arange(100, 112, dtype=np.int64)


@pytest.mark.parametrize(("where", "expected"), [
    ({"label": 1}, [101, 104, 107, 110]),
    ({"label": {"$in": [0, 2]}, "lang": "a"}, [100, 108]),
    ({"$and": [{"label": {"$gte": 1}}, {"lang": {"$ne": "b"}}]}, [102, 104, 107, 108, 110, 111]),
    ({"$or": [{"ok": True, "label": 0}, {"$id": {"$in": [101]}}]}, [100, 101, 106]),
    ({"label": {"$nin": [0]}, "$id": {"$lt": 105}}, [101, 102, 104]),
    ({"lang": {"$gt": "b"}}, [102, 103, 106, 107, 110, 111]),
])
def test_filters_select_the_rows_they_say(where: dict, expected: list[int]) -> None:
    assert matching(check_filter(where, KINDS), TABLE, IDS).tolist() == expected


def _random_filter(rng: np.random.Generator, depth: int = 0) -> dict:
    """Leaves on every column kind and operator, nested under $and / $or."""
    if depth < 2 and rng.random() < 0.4:
        return {str(rng.choice(["$and", "$or"])): [_random_filter(rng, depth + 1) for _ in range(2)]}
    column = str(rng.choice(["label", "lang", "ok", "score"]))
    values = {"label": lambda: int(rng.integers(-1, 12)), "lang": lambda: str(rng.choice(list("abcdz"))),
              "ok": lambda: bool(rng.random() < 0.5), "score": lambda: float(rng.integers(0, 4))}[column]
    ops = ["$eq", "$ne"] + ([] if column == "ok" else ["$in", "$nin", "$gt", "$lte"])
    op = str(rng.choice(ops))
    if op in ("$in", "$nin"):
        return {column: {op: [values() for _ in range(int(rng.integers(1, 4)))]}}
    return {column: values()} if op == "$eq" and rng.random() < 0.5 else {column: {op: values()}}


def test_posting_lists_select_what_the_scan_selects() -> None:
    """The build's posting lists (integers, strings, booleans; nulls included) give every filter the
    rows a pass over the columns gives; floats and columns past POSTING_VALUES are not inverted."""
    rng = np.random.default_rng(11)
    rows = POSTING_VALUES + 1000

    def with_nulls(values: list) -> list:
        return [None if rng.random() < 0.05 else v for v in values]

    table = pa.table({
        "label": pa.array(with_nulls(rng.integers(0, 10, rows).tolist()), pa.int16()),
        "lang": pa.array(with_nulls(rng.choice(list("abcd"), rows).tolist())),
        "ok": pa.array(with_nulls((rng.random(rows) < 0.3).tolist())),
        "score": pa.array(rng.integers(0, 4, rows).astype(np.float32)),
        "unique": pa.array(np.arange(rows) * 7)})
    postings = Postings(build_postings(table))
    assert postings.columns == {"label", "lang", "ok"}  # score: a float; unique: > POSTING_VALUES values
    ids = np.arange(rows, dtype=np.int64) * 3 + 5
    kinds = column_kinds(table.schema)
    for _ in range(300):
        where = check_filter(_random_filter(rng), kinds)
        assert np.array_equal(matching(where, table, ids, postings), matching(where, table, ids)), where
    assert len(matching(check_filter({"label": 99}, kinds), table, ids, postings)) == 0


def test_equal_filters_have_one_canonical_form() -> None:
    assert check_filter({"lang": "a", "label": 1}, KINDS) == check_filter({"label": 1, "lang": "a"}, KINDS)


def _nested(depth: int) -> dict:
    node: dict = {"label": 1}
    for _ in range(depth - 1):
        node = {"$and": [node]}
    return node


@pytest.mark.parametrize(("where", "says"), [
    ({"lable": 1}, "unknown column 'lable'"),
    ({"label": "3"}, "filter.label needs a number"),
    ({"lang": 3}, "filter.lang needs a string"),
    ({"label": {"$regex": 1}}, "unknown operator '$regex'"),
    ({"$not": {"label": 1}}, "unknown operator '$not'"),
    ({"label": {"$gt": 1, "$lt": 2}}, "takes one operator"),
    ({"ok": {"$gt": True}}, "does not order booleans"),
    ({"label": {"$in": list(range(MAX_IN + 1))}}, f"1 to {MAX_IN} values"),
    ({"label": {"$in": []}}, f"1 to {MAX_IN} values"),
    (_nested(MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH}"),
    ({"$id": 1.5}, "integer id"),
    ({}, "non-empty object"),
    ({"$and": []}, "non-empty list"),
    ([{"label": 1}], "non-empty object"),
])
def test_bad_filters_are_422_naming_the_filter(where: object, says: str) -> None:
    with pytest.raises(ApiError) as refused:
        check_filter(where, KINDS)
    assert refused.value.status == 422 and refused.value.field == "filter" and says in refused.value.message
    check_filter(_nested(MAX_DEPTH), KINDS)  # the deepest allowed is fine


def test_a_filter_on_an_index_without_metadata_is_refused() -> None:
    with pytest.raises(ApiError, match="without metadata"):
        check_filter({"label": 1}, {})


@pytest.fixture(scope="module")
def filtered_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("filters")
    source = write_parquet(root / "emb")
    build_index(str(source), 2, "IVF32,Flat", str(root / "idx"), backend="local", vector_column="emb",
                id_column="doc_id", metadata_columns=["caption"])
    return source, root / "idx"


def _search(index: Path, queries: np.ndarray, k: int, params: dict) -> tuple[np.ndarray, np.ndarray, int]:
    manifest, searchers = load_all_shards(str(index))
    query_params = {**params, "filter": params["filter"]}
    distances, ids = sharded_search(searchers, queries, k, query_params, manifest.metric,
                                    load_assigner(str(index)))
    matched = sum(len(s.selected(params["filter"])) for s in searchers)
    return distances, ids, matched


def test_a_filter_matching_three_rows_returns_those_three(filtered_index: tuple[Path, Path]) -> None:
    source, index = filtered_index
    manifest, _ = load_all_shards(str(index))
    rows = [5, 2500, 5999]
    kinds = manifest.dataset.metadata_kinds
    where = check_filter({"caption": {"$in": [f"caption {r}" for r in rows]}}, kinds)
    data = load_dataset(str(source), vector_column="emb", id_column="doc_id")
    _, ids, matched = _search(index, data.queries[:4], 10, {"nprobe": 1, "filter": where})
    assert matched == 3
    assert all(entry.postings is not None for entry in manifest.metadata or [])  # written by the build
    assert all(s.metadata is not None and s.metadata.postings is not None
               and s.metadata.postings.columns == {"caption"} for s in load_all_shards(str(index))[1])
    for answer in ids:  # whatever the query, the three rows and nothing else (FAISS pads with -1)
        assert sorted(i for i in answer.tolist() if i >= 0) == sorted(source_id(np.array(rows)).tolist())


def test_filtered_search_finds_the_exact_filtered_neighbours(filtered_index: tuple[Path, Path]) -> None:
    """Broad (half the ids) and selective (a 1 % id range) filters, graded against brute force
    over the matching rows only."""
    source, index = filtered_index
    manifest, _ = load_all_shards(str(index))
    data = load_dataset(str(source), vector_column="emb", id_column="doc_id")
    queries, k = data.queries[:100], 10
    for low, high in ((0, ROWS // 2), (1000, 1000 + ROWS // 100)):
        lo, hi = int(source_id(np.array(low))), int(source_id(np.array(high)))
        where = check_filter({"$and": [{"$id": {"$gte": lo}}, {"$id": {"$lt": hi}}]},
                             manifest.dataset.metadata_kinds)
        _, ids, matched = _search(index, queries, k, {"nprobe": 2, "filter": where})
        allowed = (data.ids >= lo) & (data.ids < hi)
        assert matched == int(allowed.sum())
        rows = np.flatnonzero(allowed)
        exact = ((queries[:, None, :] - data.base[rows][None, :, :]) ** 2).sum(axis=2)
        truth = data.ids[rows][np.argsort(exact, axis=1, kind="stable")[:, :k]]
        assert set(ids.ravel().tolist()) - {-1} <= set(data.ids[rows].tolist())  # nothing else comes back
        recall = np.mean([len(set(a) & set(t)) / k
                          for a, t in zip(ids.tolist(), truth.tolist(), strict=True)])
        assert recall >= 0.95, (low, high, recall)
