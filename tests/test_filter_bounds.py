"""Filters under hostile input: integers compared exactly past 2^53, a filter's size and work
bounded in the router, and the shard's per-filter caches safe while searches run on two threads.
Real FAISS, real pyarrow, no Ray; each test feeds the input that broke the filter before."""

from __future__ import annotations

import operator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pyarrow as pa
import pytest

from shardserve.data.datasets import load_dataset
from shardserve.index.indexes import prepare_vectors
from shardserve.index.metadata import ID, MetadataTable, Postings, build_postings, column_kinds
from shardserve.query.api import ApiError, ParsedQuery
from shardserve.query.cache import ByteBoundedCache
from shardserve.query.filters import (
    IN_VALUES_PER_PASS,
    MAX_FILTER_WORK,
    MAX_IN,
    MAX_LEAVES,
    MAX_VALUES,
    check_filter,
    matching,
)
from shardserve.query.parse import check_work
from shardserve.transport.shard_wire import MAX_FILTER_BYTES, ShardQuery
from tests.shared import sharded_and_unsharded

BIG = 2**60
OPS = {"$eq": operator.eq, "$ne": operator.ne, "$gt": operator.gt, "$gte": operator.ge,
       "$lt": operator.lt, "$lte": operator.le}


def _reference(where: dict, row: dict) -> bool:
    """Plain Python over one row: integers as Python integers, a null matches no comparison."""
    for key, value in where.items():
        if key == "$and":
            if not all(_reference(sub, row) for sub in value):
                return False
        elif key == "$or":
            if not any(_reference(sub, row) for sub in value):
                return False
        else:
            op, operand = next(iter(value.items())) if isinstance(value, dict) else ("$eq", value)
            held = row[key]
            if held is None:
                return False
            if op in ("$in", "$nin") and (held in operand) != (op == "$in"):
                return False
            if op in OPS and not OPS[op](held, operand):
                return False
    return True


def _table(values: list) -> tuple[pa.Table, np.ndarray, Postings]:
    table = pa.table({"big": pa.array(values, pa.int64())})
    return table, np.arange(len(values), dtype=np.int64) + 1000, Postings(build_postings(table))


def test_int64_values_one_apart_past_2_53_are_told_apart() -> None:
    """[2^60, 2^60+1, 2^60+1]: equality names row 0 alone, on the posting lists and on the scan."""
    table, ids, postings = _table([BIG, BIG + 1, BIG + 1])
    kinds = column_kinds(table.schema)
    assert kinds == {"big": "int64"}
    for lists in (postings, None):
        assert matching(check_filter({"big": BIG}, kinds), table, ids, lists).tolist() == [1000]
        for where, expected in (({"big": {"$gt": BIG}}, [1001, 1002]),
                                ({"big": {"$nin": [BIG + 1]}}, [1000])):
            assert matching(check_filter(where, kinds), table, ids, lists).tolist() == expected


@pytest.mark.parametrize("value", [2**63, 2**64 - 1, -(2**63) - 1, 2.0**62, float(BIG + 1)])
def test_values_outside_int64_or_inexact_are_422_naming_the_filter(value: object) -> None:
    kinds = {"big": "int64"}
    for where in ({"big": value}, {"big": {"$in": [1, value]}}, {"big": {"$gte": value}}):
        with pytest.raises(ApiError) as refused:
            check_filter(where, kinds)
        assert refused.value.status == 422 and refused.value.field == "filter"


def test_uint64_takes_its_whole_range_exactly() -> None:
    table = pa.table({"hash": pa.array([2**64 - 1, 2**64 - 2, 2**63], pa.uint64())})
    kinds = column_kinds(table.schema)
    ids = np.arange(3, dtype=np.int64)
    for lists in (Postings(build_postings(table)), None):
        assert matching(check_filter({"hash": 2**64 - 1}, kinds), table, ids, lists).tolist() == [0]
        below = check_filter({"hash": {"$lt": 2**64 - 1}}, kinds)
        assert matching(below, table, ids, lists).tolist() == [1, 2]
    with pytest.raises(ApiError, match="outside the uint64"):
        check_filter({"hash": -1}, kinds)


def _random_int_filter(rng: np.random.Generator, pool: list[int], depth: int = 0) -> dict:
    if depth < 2 and rng.random() < 0.35:
        op = str(rng.choice(["$and", "$or"]))
        return {op: [_random_int_filter(rng, pool, depth + 1) for _ in range(int(rng.integers(1, 4)))]}
    op = str(rng.choice(["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"]))
    pick = lambda: int(rng.choice(pool))  # noqa: E731
    if op in ("$in", "$nin"):
        return {"big": {op: [pick() for _ in range(int(rng.integers(1, 5)))]}}
    return {"big": pick()} if op == "$eq" and rng.random() < 0.3 else {"big": {op: pick()}}


def test_int64_filters_match_a_plain_python_reference() -> None:
    """Fuzz: int64 data near +-2^63 and in pairs one apart past 2^53 (with nulls), random filters
    of every operator under $and/$or; posting lists and scan both give the reference's rows."""
    rng = np.random.default_rng(42)
    edges = [-(2**63), -(2**63) + 1, 2**63 - 1, 2**63 - 2, 2**53, 2**53 + 1, 2**53 + 2, BIG, BIG + 1,
             -BIG, -BIG - 1, 0, 1, -1]
    pool = edges + [BIG + int(d) for d in rng.integers(-3, 4, 8)]
    values = [None if rng.random() < 0.05 else int(rng.choice(pool)) for _ in range(3000)]
    table, ids, postings = _table(values)
    assert "big" in postings.columns
    kinds = column_kinds(table.schema)
    for _ in range(400):
        where = _random_int_filter(rng, pool)
        canonical = check_filter(where, kinds)
        expected = [i for i, v in zip(ids.tolist(), values, strict=True) if _reference(where, {"big": v})]
        assert matching(canonical, table, ids, postings).tolist() == expected, where
        assert matching(canonical, table, ids).tolist() == expected, where


def test_older_float_keyed_posting_lists_still_match_exactly() -> None:
    """An index built before integers were keyed exactly has float64 keys ("5.0"): below 2^53 they
    are read as integers, a column with a key past it is scanned instead."""
    table, ids, _ = _table([5, BIG, BIG + 1])
    old = pa.table({"column": ["big"] * 3, "key": ["5.0", orjson.dumps(float(BIG)).decode(),
                                                  orjson.dumps(float(BIG)).decode()],
                    "rows": pa.array([[0], [1], [2]], pa.list_(pa.int32()))})
    postings = Postings(old)
    assert postings.columns == set()  # past 2^53: scanned
    kinds = column_kinds(table.schema)
    assert matching(check_filter({"big": BIG + 1}, kinds), table, ids, postings).tolist() == [1002]
    small = Postings(pa.table({"column": ["big"], "key": ["5.0"],
                               "rows": pa.array([[0]], pa.list_(pa.int32()))}))
    assert small.columns == {"big"} and small.rows("big", 5).tolist() == [0]
    # 2^53 and 2^53 + 1 were one float64 key: from 2^53 on, the column is scanned
    edge = Postings(pa.table({"column": ["big"], "key": [orjson.dumps(float(2**53)).decode()],
                              "rows": pa.array([[0, 1]], pa.list_(pa.int32()))}))
    assert edge.columns == set()


@pytest.mark.parametrize(("factory", "by"), [("Flat", "rows"), ("IVF64,Flat", "rows"), ("HNSW16", "rows")])
def test_a_searched_int64_column_returns_exactly_the_matching_rows(factory: str, by: str) -> None:
    """Values 2^60 + (id mod 50) on a served shard: equality, $in, ranges and $and with k larger
    than the matches return those rows and no other, Flat and IVF."""
    data = load_dataset("synthetic:3000x16")
    [searcher], _, _ = sharded_and_unsharded(factory, "l2", data.base, shards=1, by=by)
    row_ids = np.arange(len(data.base), dtype=np.int64)
    table = pa.table({ID: pa.array(row_ids, pa.int64()),
                      "big": pa.array((BIG + row_ids % 50).tolist(), pa.int64())})
    searcher.metadata = MetadataTable(table, Postings(build_postings(table.drop_columns([ID]))))
    kinds = {"big": "int64"}
    queries = prepare_vectors(data.queries[:3], "l2")
    for where, wanted in (({"big": BIG + 1}, {1}), ({"big": {"$in": [BIG + 7, BIG + 3]}}, {3, 7}),
                          ({"big": {"$gt": BIG + 47}}, {48, 49}), ({"big": {"$gte": BIG + 48}}, {48, 49}),
                          ({"big": {"$lt": BIG + 2}}, {0, 1}),
                          ({"$and": [{"big": {"$gte": BIG + 10}}, {"big": {"$lt": BIG + 12}}]}, {10, 11})):
        expected = sorted(int(i) for i in row_ids if int(i) % 50 in wanted)
        canonical = check_filter(where, kinds)
        k = 2 * len(expected) + 5  # more than the matches: all of them, and nothing else
        _, ids, _, matched = searcher.answer_filtered(ShardQuery(queries, k, {"filter": canonical}))
        assert matched == len(expected)
        for answer in ids:
            assert sorted(i for i in answer.tolist() if i >= 0) == expected, where


def test_a_filter_of_20000_comparisons_is_refused_by_its_count() -> None:
    kinds = {"label": "int64"}
    with pytest.raises(ApiError, match=f"more than {MAX_LEAVES} comparisons") as refused:
        check_filter({"$or": [{"label": i} for i in range(20_000)]}, kinds)
    assert refused.value.status == 422 and refused.value.field == "filter"
    check_filter({"$or": [{"label": i} for i in range(MAX_LEAVES)]}, kinds)  # the most allowed


def test_a_filters_work_is_bounded_by_the_largest_shards_rows() -> None:
    """Work = (comparisons + $in values / IN_VALUES_PER_PASS) x rows of the largest shard."""
    kinds = {"label": "int64"}
    where = {"$or": [{"label": {"$gt": i}} for i in range(64)]}  # 64 comparisons, 64 values
    passes = 64 + 64 / IN_VALUES_PER_PASS
    check_filter(where, kinds, rows=int(MAX_FILTER_WORK // passes))
    with pytest.raises(ApiError, match="more work than") as refused:
        check_filter(where, kinds, rows=int(MAX_FILTER_WORK // passes) + 1)
    assert refused.value.field == "filter"


def test_many_long_in_lists_are_refused_before_they_are_walked() -> None:
    """256 comparisons of 4,096 values each (~1M values, MBs of body): refused by the running count
    of values, not after every value was checked and sorted."""
    where = {"$or": [{"label": {"$in": list(range(MAX_IN))}} for _ in range(MAX_LEAVES)]}
    with pytest.raises(ApiError, match=f"more than {MAX_VALUES} values") as refused:
        check_filter(where, {"label": "int64"})
    assert refused.value.field == "filter"
    long = [{"caption": {"$in": ["y" * 2000 + str(i)]}} for i in range(200)]
    with pytest.raises(ApiError, match="bytes of values"):
        check_filter({"$or": long}, {"caption": "string"})


def test_a_filter_larger_than_a_shard_takes_is_refused_by_the_router() -> None:
    """The shard link carries at most MAX_FILTER_BYTES of filter: the router refuses more (a 422),
    instead of every shard refusing it and the client getting a 503 to retry forever."""
    long = ["x" * 100 + str(i) for i in range(MAX_IN)]
    with pytest.raises(ApiError, match=f"more than {MAX_FILTER_BYTES}") as refused:
        check_filter({"caption": {"$in": long}}, {"caption": "string"})
    assert refused.value.field == "filter"


def test_equal_filters_have_one_canonical_form_whatever_their_spelling() -> None:
    kinds = {"big": "int64", "score": "number", "lang": "string"}
    same = [{"big": {"$in": [3, 1, 1]}}, {"big": {"$in": [1.0, 3]}}]
    assert check_filter(same[0], kinds) == check_filter(same[1], kinds)
    assert check_filter({"big": 1}, kinds) == check_filter({"big": {"$eq": 1.0}}, kinds)
    assert check_filter({"score": 1}, kinds) == check_filter({"score": 1.0}, kinds)
    assert check_filter({"score": -0.0}, kinds) == check_filter({"score": 0}, kinds)
    assert (check_filter({"$or": [{"lang": "a"}, {"big": 2}]}, kinds)
            == check_filter({"$or": [{"big": 2}, {"lang": "a"}, {"big": 2}]}, kinds))
    # a non-integral range bound on an integer column selects what the integer bound does
    assert check_filter({"big": {"$gt": 2.5}}, kinds) == check_filter({"big": {"$gt": 2}}, kinds)
    assert check_filter({"big": {"$gte": 2.5}}, kinds) == check_filter({"big": {"$gte": 3}}, kinds)


def test_a_filters_widening_counts_in_the_work_budget() -> None:
    """A filter widens each query's probes by at least FILTER_WIDEN: the budget counts that, so a
    batch fine unfiltered is refused filtered."""
    matrix = np.zeros((600, 4), np.float32)
    plain = ParsedQuery(matrix=matrix, k=10, params=(("nprobe", 32),), single=False, require_full=False)
    check_work(plain, 65536)
    filtered = ParsedQuery(matrix=matrix, k=10, params=(("nprobe", 32),), single=False, require_full=False,
                           filter='{"label":{"$eq":1}}')
    with pytest.raises(ApiError, match="widened to 128 by the filter") as refused:
        check_work(filtered, 65536)
    assert refused.value.field == "params"


@pytest.mark.parametrize("factory", ["Flat", "IVF32,Flat"])
def test_selectors_stay_alive_under_concurrent_searches_of_many_filters(factory: str) -> None:
    """Searches under 40 distinct filters on four threads, with caches so small that every new
    filter evicts another's selector mid-search: every answer equals brute force over its rows."""
    data = load_dataset("synthetic:3000x16")
    [searcher], _, _ = sharded_and_unsharded(factory, "l2", data.base, shards=1, by="rows")
    row_ids = np.arange(len(data.base), dtype=np.int64)
    table = pa.table({ID: pa.array(row_ids, pa.int64()), "group": pa.array(row_ids % 40, pa.int32())})
    searcher.metadata = MetadataTable(table, Postings(build_postings(table.drop_columns([ID]))))
    searcher._selectors = ByteBoundedCache(1)  # holds nothing: each search builds, then drops, its own
    searcher._selected = ByteBoundedCache(4096)
    queries = prepare_vectors(data.queries[:64], "l2")
    params = {"nprobe": 32} if "IVF" in factory else {}

    def check(group: int) -> None:
        groups = [group, (group + 1) % 40, (group + 2) % 40]
        where = check_filter({"group": {"$in": groups}}, {"group": "int32"})
        rows = np.flatnonzero(np.isin(row_ids % 40, groups))
        distances, ids = searcher.search_selected(queries, 5, where, searcher.selected(where), params)
        exact = ((queries[:, None, :] - data.base[rows][None, :, :]) ** 2).sum(axis=2)
        truth = rows[np.argsort(exact, axis=1, kind="stable")[:, :5]]
        assert set(ids.ravel().tolist()) <= set(rows.tolist()), group
        assert (ids == truth).mean() > 0.99, group

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(check, [g % 40 for g in range(160)]))
