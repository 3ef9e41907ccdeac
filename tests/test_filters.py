"""Metadata filters (Chroma's `where`): checked in the router (422 naming `filter`), evaluated per
shard into a FAISS selector, planned by selectivity. Real FAISS, real parquet, no Ray."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pytest

from index_build.job import build_index
from serving.evaluate import sharded_search
from shardserve.data.datasets import load_dataset
from shardserve.index.assigner import EXACT_SHARE, FilterShares, filtered_nprobe, load_assigner
from shardserve.index.indexes import prepare_vectors
from shardserve.index.metadata import (
    ID,
    POSTING_VALUES,
    MetadataTable,
    Postings,
    build_postings,
    column_kinds,
)
from shardserve.query.api import ApiError
from shardserve.query.filters import MAX_DEPTH, MAX_IN, Among, cache_key, check_filter, filter_bytes, matching
from shardserve.query.merge import merge_topk
from shardserve.query.searcher import ShardSearcher, load_all_shards
from shardserve.transport.shard_wire import ShardQuery
from tests.shared import ROWS, sharded_and_unsharded, source_id, write_parquet

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
    values = {"label": lambda: int(rng.integers(0, 12)), "lang": lambda: str(rng.choice(list("abcdz"))),
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
    ({"label": "3"}, "filter.label needs an integer (uint8 column)"),
    ({"label": 256}, "outside the uint8 column's range"),
    ({"label": 1.5}, "needs an integer"),
    ({"label": True}, "needs an integer"),
    ({"lang": 3}, "filter.lang needs a string"),
    ({"label": {"$regex": 1}}, "unknown operator '$regex'"),
    ({"$not": {"label": 1}}, "unknown operator '$not'"),
    ({"label": {"$gt": 1, "$lt": 2}}, "takes one operator"),
    ({"ok": {"$gt": True}}, "does not order booleans"),
    ({"label": {"$in": list(range(MAX_IN + 1))}}, f"1 to {MAX_IN} values"),
    ({"label": {"$in": []}}, f"1 to {MAX_IN} values"),
    (_nested(MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH}"),
    ({"$id": 1.5}, "filter.$id needs an integer (int64 column)"),
    ({"$id": 2**63}, "outside the int64 column"),
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
    assigner = load_assigner(str(index))
    assert assigner is not None  # under a filter it ranks as many lists as a shard may take
    assert assigner.query(data.queries[:4], 10, {"nprobe": 1}).assign.shape == (4, 1)
    assert assigner.query(data.queries[:4], 10, {"nprobe": 1, "filter": where}).assign.shape == (4, 16)
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


GROUPS = 20  # `group` = id mod 20: one group is 5 % of every shard's rows, whatever the dealing


def _with_groups(searcher: ShardSearcher) -> None:
    """The searcher's rows get metadata `group` (id mod GROUPS), with the build's posting lists."""
    ids = np.sort(searcher._id_map() if isinstance(searcher.index, faiss.IndexIDMap)
                  else np.concatenate([faiss.rev_swig_ptr(searcher.ivf.invlists.get_ids(lst),
                                                          searcher.ivf.invlists.list_size(lst)).copy()
                                       for lst in range(searcher.ivf.nlist)]))
    table = pa.table({ID: pa.array(ids, pa.int64()), "group": pa.array(ids % GROUPS, pa.int32())})
    searcher.metadata = MetadataTable(table, Postings(build_postings(table.drop_columns([ID]))))


@pytest.mark.parametrize(("factory", "by"), [
    ("Flat", "rows"), ("HNSW16", "rows"), ("IVF64,Flat", "ivf-lists"), ("IVF64,Flat", "rows"),
    ("IVF64,SQ8", "ivf-lists"), ("IVF64,PQ8x4fs,RFlat", "rows")])
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_sharded_filtered_search_equals_unsharded(factory: str, by: str, metric: str) -> None:
    """The unfiltered equality, filtered. A selective filter (two groups, 10 %: every shard and the
    unsharded index compare the query with each matching row) gives the unsharded answers for every
    index type and dealing. A broad one (12 groups, 60 %) searched at the same params with the
    selector pushed into each shard's scan gives them for IVF, whose lists do not depend on the
    dealing; HNSW graphs do (a shard's graph is not the unsharded one), unfiltered too."""
    data = load_dataset("synthetic:6000x32")
    searchers, unsharded, _ = sharded_and_unsharded(factory, metric, data.base, by=by)
    for searcher in [*searchers, unsharded]:
        _with_groups(searcher)
    queries, k, ip = prepare_vectors(data.queries[:200], metric), 10, metric != "l2"
    kinds = {"group": "number"}
    selective = check_filter({"group": {"$in": [3, 17]}}, kinds)
    query = ShardQuery(queries, k, {"nprobe": 4, "filter": selective})
    answers = [s.answer_filtered(query) for s in searchers]
    distances, ids = merge_topk([a[0] for a in answers], [a[1] for a in answers], k, ip)
    expected_d, expected_i, _, expected_matched = unsharded.answer_filtered(query)
    assert sum(a[3] for a in answers) == expected_matched == len(data.base) // 10
    assert np.array_equal(ids, expected_i) and np.allclose(distances, expected_d, rtol=1e-5, atol=1e-4)
    if "IVF" not in factory:
        return
    broad = check_filter({"group": {"$lt": 12}}, kinds)
    for nprobe in (1, 8):
        parts = [s.search_selected(queries, k, broad, s.selected(broad), {"nprobe": nprobe})
                 for s in searchers]
        distances, ids = merge_topk([p[0] for p in parts], [p[1] for p in parts], k, ip)
        expected_d, expected_i = unsharded.search_selected(queries, k, broad, unsharded.selected(broad),
                                                           {"nprobe": nprobe})
        real = expected_i >= 0
        assert np.array_equal(distances[real], expected_d[real]), nprobe
        if "fs" not in factory:  # fast-scan's quantized distances tie often: ties may swap ids
            assert np.array_equal(ids[real], expected_i[real]), nprobe
        assert set(ids[real].ravel() % GROUPS) <= set(range(12))


def test_eval_grades_a_filter_on_the_users_parquet(filtered_index: tuple[Path, Path]) -> None:
    """`shardserve eval --filter` on a parquet source reads the metadata columns the build stored."""
    from serving.evaluate import evaluate

    source, index = filtered_index
    captions = [f"caption {r}" for r in range(0, ROWS, 3)]
    result = evaluate(str(index), str(source), k=10, params={"nprobe": 2},
                      where={"caption": {"$in": captions[:MAX_IN]}})
    assert result["matching_rows"] == min(len(captions), MAX_IN)
    assert result["recall"] >= 0.95, result


def test_gathered_vectors_stay_within_one_copy_of_the_shard() -> None:
    """Exact filtered search keeps each filter's matching vectors gathered for its next batches; all
    of them together never hold more rows than the shard, the oldest filter dropped first."""
    data = load_dataset("synthetic:4000x16")
    [searcher], _, _ = sharded_and_unsharded("IVF16,Flat", "l2", data.base, shards=1, by="rows")
    _with_groups(searcher)
    queries = prepare_vectors(data.queries[:5], "l2")
    kinds = {"group": "number"}
    for first in range(0, GROUPS, 4):  # 5 filters of 4 groups: 20 % of the rows each, 100 % in all
        where = check_filter({"group": {"$in": list(range(first, first + 4))}}, kinds)
        searcher.answer_filtered(ShardQuery(queries, 10, {"filter": where}))
        held = sum(int(flat.ntotal) for flat in searcher._gathered.values())
        assert held <= searcher.index.ntotal and where in searcher._gathered
    assert len(searcher._gathered) == 5  # exactly one copy fits: nothing dropped yet
    where = check_filter({"group": {"$in": [0, 5]}}, kinds)
    searcher.answer_filtered(ShardQuery(queries, 10, {"filter": where}))
    assert len(searcher._gathered) == 5 and where in searcher._gathered  # the oldest made room
    assert sum(int(flat.ntotal) for flat in searcher._gathered.values()) <= searcher.index.ntotal


@pytest.mark.parametrize("by", ["ivf-lists", "rows"])
def test_filtered_shards_take_their_lists_from_the_routers_ranking(by: str) -> None:
    """Under a broad filter the router ranks as many lists as a shard may probe, and each shard
    scans the prefix its own share asks for: the answers of each shard's own quantizer, exactly."""
    data = load_dataset("synthetic:6000x32")
    searchers, _, assigner = sharded_and_unsharded("IVF64,Flat", "l2", data.base, by=by)
    queries = prepare_vectors(data.queries[:100], "l2")
    for searcher in searchers:
        _with_groups(searcher)
    broad = check_filter({"group": {"$lt": 13}}, {"group": "number"})  # 65 %: the widened IVF scan
    routed = assigner.query(queries, 10, {"nprobe": 4, "filter": broad})
    assert routed.assign is not None and routed.assign.shape[1] > 4  # ranked deeper than nprobe
    for searcher in searchers:
        alone = ShardQuery(queries, 10, {"nprobe": 4, "filter": broad})  # its own quantizer
        own_d, own_i, _, matched = searcher.answer_filtered(alone)
        got_d, got_i, _, got_matched = searcher.answer_filtered(routed)
        assert matched == got_matched > 0
        assert np.array_equal(got_i, own_i) and np.array_equal(got_d, own_d)
        assert set(got_i[got_i >= 0].ravel() % GROUPS) <= set(range(13))


def test_filter_shares_rank_only_the_lists_some_shard_takes() -> None:
    shares = FilterShares([1000, 1000, 500], kept=2)
    assert shares.lists("a", 16, 1024) is None  # not learned: the caller ranks the most
    shares.learn("a", [10, 250, 5])  # every share <= EXACT_SHARE: every shard compares exactly
    assert shares.lists("a", 16, 1024) == 0
    shares.learn("b", [600, 100, 300])  # 60 %, 10 %, 60 %
    widest = filtered_nprobe(16, 0.6, 1024)
    assert shares.lists("b", 16, 1024) == widest < filtered_nprobe(16, EXACT_SHARE, 1024)
    shares.learn("c", [400, None, 500])  # a shard did not answer: nothing learned
    assert shares.lists("c", 16, 1024) is None
    shares.learn("d", [0, 0, 0])  # kept=2: the first learned ("a") goes
    assert shares.lists("a", 16, 1024) is None and shares.lists("d", 16, 1024) == 0


@pytest.mark.parametrize("by", ["ivf-lists", "rows"])
def test_a_learned_filter_ranks_fewer_lists_and_answers_the_same(by: str) -> None:
    """Once the shards have said what a filter matched, the router ranks only what they take: no
    lists when each compares exactly, the widest share's prefix otherwise. Each shard's answers are
    those of its own quantizer, exactly, as before."""
    data = load_dataset("synthetic:6000x32")
    searchers, _, assigner = sharded_and_unsharded("IVF64,Flat", "l2", data.base, by=by)
    queries = prepare_vectors(data.queries[:100], "l2")
    for searcher in searchers:
        _with_groups(searcher)
    shares = FilterShares([int(s.index.ntotal) for s in searchers])
    kinds = {"group": "number"}
    for where, lists in ((check_filter({"group": {"$lt": 13}}, kinds), "some"),  # 65 %: widened IVF
                         (check_filter({"group": {"$in": [3, 4]}}, kinds), "none")):  # 10 %: exact
        first = assigner.query(queries, 10, {"nprobe": 4, "filter": where}, shares)
        answers = [s.answer_filtered(first) for s in searchers]
        shares.learn(where, [matched for *_, matched in answers])
        learned = assigner.query(queries, 10, {"nprobe": 4, "filter": where}, shares)
        if lists == "none":
            assert learned.assign is None
        else:
            assert learned.assign is not None and 4 < learned.assign.shape[1] < first.assign.shape[1]
        for searcher, (d, i, _, matched) in zip(searchers, answers, strict=True):
            own_d, own_i, _, own_matched = searcher.answer_filtered(
                ShardQuery(queries, 10, {"nprobe": 4, "filter": where}))  # its own quantizer
            got_d, got_i, _, got_matched = searcher.answer_filtered(learned)
            assert matched == own_matched == got_matched  # with rows dealt, a shard may match none
            assert np.array_equal(got_i, own_i) and np.array_equal(got_d, own_d)
            assert np.array_equal(i, own_i) and np.array_equal(d, own_d)
        assert sum(matched for *_, matched in answers) > 0


def test_an_among_is_its_ids_and_its_text_alone_is_no_filter() -> None:
    """Among (the in-process form Chroma's API searches with) is keyed by the digest of its distinct
    ids, evaluated by membership, charged to a cache with its ids; a plain string of its text (no
    checked filter can be one) is refused before any cache is looked in."""
    among = Among.of(np.array([7, 3, 7, 11]))
    assert among == Among.of(np.array([11, 3, 7])) and among != Among.of(np.array([3, 7]))
    table = pa.table({"x": pa.array([0, 0, 0, 0])})
    assert matching(among, table, np.array([3, 4, 11, 12])).tolist() == [3, 11]
    assert cache_key(among) is among and filter_bytes(among) == len(among) + 3 * 8
    with pytest.raises(ApiError) as refused:
        cache_key(str(among))
    assert refused.value.status == 422
    assert cache_key('{"x":{"$eq":0}}') == '{"x":{"$eq":0}}'
