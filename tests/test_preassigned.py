"""Quantize once in the router, search_preassigned in every shard: answers byte-equal to the
unsharded index at the same params; the wire format; index types whose params used to crash."""

from __future__ import annotations

import struct
import subprocess
import sys

import faiss
import numpy as np
import pytest

from serving.evaluate import sharded_search
from shardserve.data.datasets import load_dataset
from shardserve.index.assigner import CoarseAssigner
from shardserve.index.indexes import (
    BLAS_MIN_ROWS,
    add_to_copy,
    flat_search_with_blas_from,
    index_from_bytes,
    prepare_vectors,
    train_empty_index,
)
from shardserve.index.partition import BY_LISTS, BY_ROWS
from shardserve.query.list_scan import search_by_lists
from shardserve.query.render import hits
from shardserve.query.searcher import ShardSearcher
from shardserve.transport.shard_wire import QueryBounds, ShardQuery, decode_answer, encode_answer
from tests.shared import sharded_and_unsharded


@pytest.mark.parametrize("factory, metric", [("IVF64,Flat", "l2"), ("IVF64,Flat", "ip"),
                                             ("IVF64,Flat", "cosine"),
                                             pytest.param("IVF64,PQ8", "l2", marks=pytest.mark.slow),
                                             ("IVF64,PQ16x4fs", "l2"), ("IVF64,SQ8", "ip")])
@pytest.mark.parametrize("by", [BY_LISTS, BY_ROWS])
def test_quantize_once_equals_unsharded(factory: str, metric: str, by: str) -> None:
    data = load_dataset("synthetic:8000x32")
    searchers, unsharded, assigner = sharded_and_unsharded(factory, metric, data.base, by=by)
    assert assigner is not None
    queries = data.queries[:300]
    for nprobe in (1, 7, 64, 200):  # 200 > nlist: clamped like FAISS does
        params = {"nprobe": nprobe}
        distances, ids = sharded_search(searchers, queries, 10, params, metric, assigner)
        expected_d, expected_i, _ = unsharded.search(queries, 10, params)
        real = expected_i >= 0
        assert np.array_equal(distances[real], expected_d[real]), (factory, metric, nprobe)
        if "fs" not in factory:  # fast-scan's quantized distances tie often: ties may swap ids
            assert np.array_equal(ids[real], expected_i[real]), (factory, metric, nprobe)
        # and the plain path (each shard runs the quantizer itself) agrees with it
        _, plain_ids = sharded_search(searchers, queries, 10, params, metric)
        assert np.array_equal(plain_ids, ids)


def test_row_order_of_a_large_batch_changes_no_answer() -> None:
    """Large batches are scanned list by list (IVF-Flat, query.list_scan, here forced: these lists are
    small enough for query.scan_choice to leave them to FAISS) or in list order (LIST_ORDER_ROWS) and
    answered in the caller's order, as FAISS's scan of them in arrival order and one query at a time
    answers."""
    data = load_dataset("synthetic:8000x32")
    for factory in ("IVF64,Flat", "IVF64,SQ8"):
        searchers, _, assigner = sharded_and_unsharded(factory, "l2", data.base)
        query = assigner.query(prepare_vectors(data.queries[:300], "l2"), 10, {"nprobe": 7})
        for searcher in searchers:
            assert (searcher.scan_choice is not None) == (factory == "IVF64,Flat")
            if searcher.scan_choice is not None:
                searcher.scan_choice.forced = True
            ordered_d, ordered_i, _ = searcher.answer(query)
            searcher.list_order_rows = 10**9
            if searcher.scan_choice is not None:
                searcher.scan_choice.forced = False
            arrival_d, arrival_i, _ = searcher.answer(query)
            assert np.array_equal(ordered_i, arrival_i) and np.array_equal(ordered_d, arrival_d)
            rows = [searcher.answer(ShardQuery(query.matrix[r:r + 1], 10, query.params, query.assign[r:r + 1],
                                               query.coarse[r:r + 1]))[1][0] for r in range(0, 300, 37)]
            assert np.array_equal(np.stack(rows), ordered_i[::37])


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_list_by_list_scan_keeps_faiss_answers_through_ties(metric: str) -> None:
    """Small integer vectors, many of them duplicates: the k-th distance ties often, the rows where
    it does are scanned again FAISS's way, and every row answers as FAISS's own scan does (ids in
    the same order too: FAISS sorts ties by id)."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 3, (6000, 8)).astype(np.float32)
    searchers, _, assigner = sharded_and_unsharded("IVF16,Flat", metric, base)
    queries = prepare_vectors(rng.integers(0, 3, (400, 8)).astype(np.float32), metric)
    for k, nprobe in ((10, 4), (1, 1), (50, 16)):
        query = assigner.query(queries, k, {"nprobe": nprobe})
        tied = 0
        for searcher in searchers:
            assert searcher.nonempty is not None and searcher.scan_choice is not None
            distances, ids, again = search_by_lists(
                searcher.ivf, searcher.nonempty, query.matrix, query.assign, query.coarse, k,
                metric != "l2", faiss.SearchParametersIVF(nprobe=1))
            expected_d, expected_i = searcher._scan(query.matrix, query.assign, query.coarse, k)
            tied += len(again)
            settled = np.setdiff1d(np.arange(len(queries)), again)
            assert np.array_equal(ids[settled], expected_i[settled]), (metric, k, nprobe)
            assert np.array_equal(distances[settled], expected_d[settled]), (metric, k, nprobe)
            searcher.scan_choice.forced = True  # small lists: the byte rule would leave them to FAISS
            got_d, got_i, _ = searcher.answer(query)  # the tied rows too, once scanned again
            assert np.array_equal(got_i, expected_i) and np.array_equal(got_d, expected_d)
        assert tied > 0, (metric, k, nprobe)  # the ties this test is about did happen


@pytest.mark.data
def test_fashion_mnist_quantize_once_equals_unsharded() -> None:
    data = load_dataset("fashion-mnist", limit=12000, num_queries=200)
    searchers, unsharded, assigner = sharded_and_unsharded("IVF128,Flat", "l2", data.base)
    queries = prepare_vectors(data.queries, "l2")
    distances, ids = sharded_search(searchers, queries, 10, {"nprobe": 16}, "l2", assigner)
    expected_d, expected_i, _ = unsharded.search(queries, 10, {"nprobe": 16}, prepared=True)
    assert np.array_equal(ids, expected_i) and np.array_equal(distances, expected_d)


def test_non_ivf_has_no_assigner() -> None:
    data = load_dataset("synthetic:2000x16")
    for factory in ("Flat", "HNSW16", "IVF16,PQ4x4fs,RFlat"):
        empty = train_empty_index(factory, "l2", data.base, seed=1)
        assert CoarseAssigner.from_trained(index_from_bytes(empty)) is None, factory


BOUNDS = QueryBounds(dim=12, nlist=64, max_rows=8, max_k=10, params=frozenset({"nprobe"}))


def test_wire_round_trip() -> None:
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((5, 12)).astype(np.float32)
    assign = rng.integers(0, 64, (5, 3))
    coarse = rng.standard_normal((5, 3)).astype(np.float32)
    for query in (ShardQuery(matrix, 7, {"nprobe": 3}, assign, coarse), ShardQuery(matrix, 2, {})):
        blob = query.encode()
        assert query.encode() is blob  # encoded once, however many shards it goes to
        back = ShardQuery.decode(blob, BOUNDS)
        assert np.array_equal(back.matrix, matrix) and back.k == query.k and back.params == query.params
        if query.assign is not None:
            assert np.array_equal(back.assign, assign) and np.array_equal(back.coarse, coarse)
        else:
            assert back.assign is None
    distances, ids = coarse[:, :2].copy(), assign[:, :2].copy()
    got_d, got_i, ms, matched, position = decode_answer(encode_answer(distances, ids, 1.5, 42, 1 << 40))
    assert np.array_equal(got_d, distances) and np.array_equal(got_i, ids)
    assert (ms, matched, position) == (1.5, 42, 1 << 40)
    old = struct.pack("<4sIIdq", b"SSA2", *ids.shape, 1.5, 42) + distances.tobytes() + ids.tobytes()
    got_d, got_i, ms, matched, position = decode_answer(old)  # a shard of the release before
    assert np.array_equal(got_d, distances) and np.array_equal(got_i, ids) and (ms, matched, position) == (
        1.5, 42, 0)
    with pytest.raises(ValueError, match="magic"):
        ShardQuery.decode(b"XXXX" + blob[4:], BOUNDS)
    with pytest.raises(ValueError, match="bytes"):
        ShardQuery.decode(ShardQuery(matrix, 2, {}).encode() + b"junk", BOUNDS)


def _bad_frames() -> dict[str, bytes]:
    """One hostile frame per field, each otherwise well formed (lengths consistent with the header)."""
    rng = np.random.default_rng(1)
    m = rng.standard_normal((3, 12)).astype(np.float32)
    assign, coarse = rng.integers(0, 64, (3, 2)), rng.standard_normal((3, 2)).astype(np.float32)
    good = ShardQuery(m, 5, {"nprobe": 2}, assign, coarse).encode()
    header = struct.Struct("<4sIIIII")

    def with_header(**fields) -> bytes:
        values = dict(zip(("magic", "n", "dim", "k", "nprobe", "params_len"), header.unpack_from(good),
                          strict=True))
        values.update(fields)
        return header.pack(*values.values()) + good[header.size:]

    return {
        "dim 1, the index has 12": ShardQuery(m[:, :1].copy(), 5, {}).encode(),
        "dim 1, the index has 12 ": with_header(dim=1),  # the header lies about the buffer
        "rows 0": ShardQuery(m[:0], 5, {}).encode(),
        "rows 9": ShardQuery(np.zeros((9, 12), np.float32), 5, {}).encode(),
        "rows 4294967295": with_header(n=2**32 - 1),
        "k 0": ShardQuery(m, 0, {}).encode(),
        "k 11": ShardQuery(m, 11, {}).encode(),
        "nprobe 65": ShardQuery(m, 5, {}, rng.integers(0, 64, (3, 65)),
                                np.zeros((3, 65), np.float32)).encode(),
        "list numbers": ShardQuery(m, 5, {}, np.full((3, 2), 64), coarse).encode(),
        "list numbers ": ShardQuery(m, 5, {}, np.full((3, 2), -7), coarse).encode(),
        "params of": with_header(params_len=2**20),
        "header says": good[:-3],
        "shorter than its header": good[:10],
        "params must be an object": ShardQuery(m, 5, {"efSearch": 4}).encode(),
        "param nprobe": ShardQuery(m, 5, {"nprobe": 65}).encode(),
        "param nprobe ": ShardQuery(m, 5, {"nprobe": True}).encode(),
    }


@pytest.mark.parametrize("expected", list(_bad_frames()))
def test_every_field_of_a_frame_is_checked_before_faiss(expected: str) -> None:
    with pytest.raises(ValueError, match=expected.strip()):
        ShardQuery.decode(_bad_frames()[expected], BOUNDS)


def test_no_frame_reaches_faiss_with_a_buffer_shorter_than_its_header_says() -> None:
    """Every frame a shard accepts, cut or padded anywhere, is either refused or decodes into arrays
    exactly as long as their shapes (what FAISS reads)."""
    rng = np.random.default_rng(2)
    good = ShardQuery(rng.standard_normal((3, 12)).astype(np.float32), 5, {"nprobe": 2},
                      rng.integers(0, 64, (3, 2)), rng.standard_normal((3, 2)).astype(np.float32)).encode()
    for cut in range(len(good) + 8):
        blob = good[:cut] if cut <= len(good) else good + bytes(cut - len(good))
        try:
            query = ShardQuery.decode(blob, BOUNDS)
        except ValueError:
            continue
        assert cut == len(good)
        assert query.matrix.shape == (3, 12) and query.matrix.nbytes == 3 * 12 * 4
        assert query.assign.shape == query.coarse.shape == (3, 2)


def test_padding_never_leaves_the_server() -> None:
    ids = np.array([4, 9, -1, -1])
    distances = np.array([0.5, 1.0, 3.4e38, 3.4e38], np.float32)
    assert hits(ids, distances)["ids"].tolist() == [4, 9]
    assert hits(ids, distances)["distances"].tolist() == [0.5, 1.0]


def test_supported_params_in_a_fresh_interpreter() -> None:
    """Was a segfault: the IDMap wrapper was freed while its inner index was still in use."""
    code = ("from shardserve.index.indexes import supported_params\n"
            "for f in ['HNSW32', 'Flat', 'PQ16', 'IVF64,Flat', 'IVF64,PQ16x4fs,RFlat']:\n"
            "    print(f, sorted(supported_params(f, 784, 'l2')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:5] == [
        "HNSW32 ['efSearch']", "Flat []", "PQ16 []", "IVF64,Flat ['nprobe']",
        "IVF64,PQ16x4fs,RFlat ['nprobe']"]


def test_refine_searches_with_per_request_nprobe() -> None:
    data = load_dataset("synthetic:4000x32")
    empty = train_empty_index("IVF32,PQ8x4fs,RFlat", "l2", data.base, seed=1)
    searcher = ShardSearcher(add_to_copy(empty, data.base, np.arange(len(data.base))), "l2", "r", "v")
    _, ids, _ = searcher.search(data.queries[:50], 10, {"nprobe": 8})
    exact = faiss.knn(data.queries[:50], data.base, 10)[1]
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, exact, strict=True)])
    assert recall > 0.8


@pytest.mark.data
def test_router_batches_on_blas_answer_as_single_queries_do() -> None:
    """The router's quantizer takes BLAS from BLAS_MIN_ROWS rows (index.indexes); the lists it picks,
    hence the answers, are those of FAISS's per-query kernels (one query at a time, as a plain
    server searches)."""
    data = load_dataset("fashion-mnist", limit=12000, num_queries=280)
    searchers, unsharded, assigner = sharded_and_unsharded("IVF128,Flat", "l2", data.base)
    queries, params = prepare_vectors(data.queries, "l2"), {"nprobe": 16}
    faiss_default = faiss.cvar.distance_compute_blas_threshold
    try:  # process-wide: the tests after this one get FAISS's own setting back
        flat_search_with_blas_from(1 << 30, queries.shape[1])  # never BLAS
        expected_d, expected_i, _ = unsharded.search(queries, 10, params, prepared=True)
        flat_search_with_blas_from(BLAS_MIN_ROWS, queries.shape[1])
        for start in range(0, len(queries), 14):  # a router batch under load
            rows = slice(start, start + 14)
            distances, ids = sharded_search(searchers, queries[rows], 10, params, "l2", assigner)
            assert np.array_equal(ids, expected_i[rows]) and np.array_equal(distances, expected_d[rows])
    finally:
        faiss.cvar.distance_compute_blas_threshold = faiss_default
