"""The half-precision scan (query.half_scan): FAISS's own answers, distances bit for bit, whether
the bound settles a row, a tie sends it back to FAISS, or nothing is settled at all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import faiss
import numpy as np
import pytest

from index_build.job import build_index
from shardserve.data.datasets import load_dataset
from shardserve.index.indexes import prepare_vectors
from shardserve.query import scan_choice
from shardserve.query import searcher as searcher_module
from shardserve.query.half_scan import GATE_PROBE, KEPT_FACTOR, HalfCopy
from shardserve.query.searcher import Exclusion, ShardSearcher, load_all_shards
from shardserve.transport.shard_wire import ShardQuery
from tests.shared import sharded_and_unsharded


def with_half(searcher: ShardSearcher) -> HalfCopy:
    """These lists fit in a core's cache, so the searcher makes no copy itself: make it."""
    assert searcher.half is None and searcher.ivf is not None
    half = HalfCopy.of(searcher.ivf)
    assert half is not None
    searcher.half = half
    return half


def faiss_answer(searcher: ShardSearcher, query: ShardQuery, sel: faiss.IDSelector | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    return searcher._scan(query.matrix, query.assign, query.coarse, query.k, sel)


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("by_lists", [False, True])
def test_answers_are_faiss_own_bit_for_bit(metric: str, by_lists: bool) -> None:
    data = load_dataset("synthetic:8000x32")
    searchers, _, assigner = sharded_and_unsharded("IVF64,Flat", metric, data.base)
    settled = 0
    for k, nprobe in ((10, 7), (1, 1), (40, 64)):
        query = assigner.query(prepare_vectors(data.queries[:300], metric), k, {"nprobe": nprobe})
        for searcher in searchers:
            half = searcher.half or with_half(searcher)
            assert searcher.scan_choice is not None
            searcher.scan_choice.forced = by_lists
            found_d, found_i = searcher._scan_choosing(half.index, query.matrix, query.assign, query.coarse,
                                                       KEPT_FACTOR * k, None, settle_ties=False)
            _, _, again = half.rerank(query.matrix, found_d, found_i, k, metric != "l2")
            settled += len(query.matrix) - len(again)
            distances, ids, _ = searcher.answer(query)
            expected_d, expected_i = faiss_answer(searcher, query)
            assert np.array_equal(ids, expected_i), (metric, k, nprobe)
            assert np.array_equal(distances, expected_d), (metric, k, nprobe)
    assert settled > 0  # the bound settled rows: not every answer came from the fallback


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_ties_and_unsettled_rows_go_back_to_faiss(metric: str) -> None:
    """Small integer vectors, many duplicates: the k-th distance ties often (FAISS keeps whichever
    it scanned first), and those rows are FAISS's. With a bound too loose to settle anything, every
    row is FAISS's too."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 3, (6000, 8)).astype(np.float32)
    searchers, _, assigner = sharded_and_unsharded("IVF16,Flat", metric, base)
    query = assigner.query(prepare_vectors(rng.integers(0, 3, (400, 8)).astype(np.float32), metric), 10,
                           {"nprobe": 4})
    for searcher in searchers:
        half = with_half(searcher)
        assert half.error == 0.0  # small integers are exact in half precision
        found_d, found_i = searcher._scan(query.matrix, query.assign, query.coarse, KEPT_FACTOR * 10,
                                          ivf=half.index)
        _, _, again = half.rerank(query.matrix, found_d, found_i, 10, metric != "l2")
        assert len(again) > 0  # the ties this test is about did happen
        expected_d, expected_i = faiss_answer(searcher, query)
        for copy in (half, dataclasses.replace(half, error=1e6)):
            searcher.half = copy
            distances, ids, _ = searcher.answer(query)
            assert np.array_equal(ids, expected_i) and np.array_equal(distances, expected_d)
        loose = dataclasses.replace(half, error=1e6)
        _, _, again = loose.rerank(query.matrix, found_d, found_i, 10, metric != "l2")
        assert len(again) == np.count_nonzero(found_i[:, -1] >= 0)  # only rows with all candidates settle


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_excluded_ids_stay_out(metric: str) -> None:
    """A delta's tombstones (a selector over ids) hold in the copy's scan as in FAISS's."""
    data = load_dataset("synthetic:8000x32")
    searchers, _, assigner = sharded_and_unsharded("IVF64,Flat", metric, data.base)
    query = assigner.query(prepare_vectors(data.queries[:200], metric), 10, {"nprobe": 7})
    for searcher in searchers:
        with_half(searcher)
        _, before = searcher.answer(query)[:2]
        gone = np.unique(before[:, :3][before[:, :3] >= 0])
        batch = faiss.IDSelectorBatch(gone)
        exclusion = Exclusion(gone, faiss.IDSelectorNot(batch), held=(batch,))
        distances, ids, _ = searcher.answer(query, exclusion)
        assert not np.isin(ids, gone).any()
        expected_d, expected_i = faiss_answer(searcher, query, exclusion.selector)
        assert np.array_equal(ids, expected_i) and np.array_equal(distances, expected_d)


def test_a_list_half_precision_cannot_hold_is_unbounded_and_the_others_are_copied() -> None:
    """A value beyond half precision's largest (one upsert compacted in) used to cost the whole
    shard its copy: now only its list is unbounded, and every query probing it is FAISS's."""
    rng = np.random.default_rng(1)
    base = rng.normal(0, 1, (4000, 8)).astype(np.float32)
    base[7] = 70000.0  # beyond half precision's largest value
    searchers, _, assigner = sharded_and_unsharded("IVF8,Flat", "l2", base)
    query = assigner.query(prepare_vectors(rng.normal(0, 1, (300, 8)).astype(np.float32), "l2"), 10,
                           {"nprobe": 2})
    unbounded = 0
    for searcher in searchers:
        half = with_half(searcher)
        assert half is not None and half.list_errors is not None
        held = int(np.isinf(half.list_errors).sum())
        unbounded += held
        distances, ids, again = copy_answer(searcher, half, query, "l2")
        expected_d, expected_i = faiss_answer(searcher, query)
        assert np.array_equal(ids, expected_i) and np.array_equal(distances, expected_d)
        probes_it = np.isinf(half.list_errors[np.maximum(query.assign, 0)]).any(axis=1)
        assert set(np.flatnonzero(probes_it)) <= set(again.tolist())  # all of these are FAISS's
        assert len(again) < len(query.matrix)  # and the copy settles others
    assert unbounded == 1


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_one_point_of_huge_components_loosens_only_its_own_list_s_bound(metric: str) -> None:
    """An upsert with huge components compacted into one list grew the copy's single bound from
    0.0034 to 6.66, and no query was settled by the copy any more. Bounds are per list: queries
    that do not probe that list settle as before."""
    rng = np.random.default_rng(3)
    base = rng.normal(0, 1, (6000, 16)).astype(np.float32)
    base[11] = 30000.0 + rng.normal(0, 1, 16)  # fits half precision, loosely (a step of 16)
    searchers, _, assigner = sharded_and_unsharded("IVF16,Flat", metric, base)
    query = assigner.query(prepare_vectors(rng.normal(0, 1, (400, 16)).astype(np.float32), metric), 10,
                           {"nprobe": 2})
    settled_per_list = settled_global = 0
    for searcher in searchers:
        half = with_half(searcher)
        distances, ids, again = copy_answer(searcher, half, query, metric)
        expected_d, expected_i = faiss_answer(searcher, query)
        assert np.array_equal(ids, expected_i) and np.array_equal(distances, expected_d)
        assert half.list_errors is not None
        if half.error < 1.0:
            continue  # not the shard holding the point
        settled_per_list += len(query.matrix) - len(again)
        one_bound = dataclasses.replace(half, list_errors=None, list_norms=None)
        settled_global += len(query.matrix) - len(copy_answer(searcher, one_bound, query, metric)[2])
    assert settled_per_list > 1.25 * settled_global  # measured: 400 against 264 (l2), 340 against 203 (ip)


def test_a_copy_only_where_lists_outgrow_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard makes the copy where its scan is bound by reading lists larger than a core's cache:
    not for these small ones, nor for codes that are not float32; on a core with a smaller cache,
    for the same lists."""
    data = load_dataset("synthetic:8000x32")
    for factory in ("IVF64,Flat", "IVF64,SQ8"):
        searchers, _, _ = sharded_and_unsharded(factory, "l2", data.base)
        assert not any(s.make_half_copy() for s in searchers)
    monkeypatch.setattr(scan_choice, "cache_bytes", lambda: 1024)  # smaller than every list here
    for factory, made in (("IVF64,Flat", True), ("IVF64,SQ8", False)):
        searchers, _, _ = sharded_and_unsharded(factory, "l2", data.base)
        assert all(s.make_half_copy() is made for s in searchers)


def test_shards_loaded_to_be_merged_get_no_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The monolith baseline merges the shards it loads: FAISS refuses to merge an index with the
    direct map the copy needs, so loading for a merge makes none."""
    monkeypatch.setattr(scan_choice, "cache_bytes", lambda: 1024)
    built = str(tmp_path / "index")
    build_index("synthetic:8000x32", 2, "IVF64,Flat", built, backend="local")
    _, mapped = load_all_shards(built)
    assert all(s.half is not None for s in mapped)
    _, merged = load_all_shards(built, mmap=False)
    assert all(s.half is None for s in merged)
    first = faiss.clone_index(merged[0].index)
    first.merge_from(merged[1].index, 0)  # no direct map: FAISS merges


def test_a_batch_too_wide_to_pool_is_scanned_query_by_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list-by-list scan holds every (row, probe, k+1) candidate at once: past POOL_BYTES the batch
    is scanned query by query instead, with the same answers."""
    data = load_dataset("synthetic:8000x32")
    searchers, _, assigner = sharded_and_unsharded("IVF64,Flat", "l2", data.base)
    query = assigner.query(prepare_vectors(data.queries[:300], "l2"), 10, {"nprobe": 64})
    searcher = searchers[0]
    with_half(searcher)
    assert searcher.scan_choice is not None
    searcher.scan_choice.forced = True
    pooled_d, pooled_i, _ = searcher.answer(query)
    pooled = searcher._pool_bytes(query.assign, KEPT_FACTOR * 10)
    monkeypatch.setattr(searcher_module, "POOL_BYTES", pooled - 1)

    def refuse(*_args: object) -> None:
        raise AssertionError("pooled past POOL_BYTES")

    monkeypatch.setattr(searcher_module, "search_by_lists", refuse)
    distances, ids, _ = searcher.answer(query)
    assert np.array_equal(ids, pooled_i) and np.array_equal(distances, pooled_d)


def copy_answer(searcher: ShardSearcher, half: HalfCopy, query: ShardQuery, metric: str
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What answer() does with the copy, without its gate: the rows not settled are FAISS's."""
    found_d, found_i = searcher._scan_choosing(half.index, query.matrix, query.assign, query.coarse,
                                               KEPT_FACTOR * query.k, None, settle_ties=False)
    distances, ids, again = half.rerank(query.matrix, found_d, found_i, query.k, metric != "l2", query.assign)
    distances[again], ids[again] = searcher._scan(query.matrix[again], query.assign[again],
                                                  query.coarse[again], query.k)
    return distances, ids, again


@pytest.mark.parametrize("by_lists", [False, True])
def test_the_bound_is_what_keeps_the_answers_faiss_own(monkeypatch: pytest.MonkeyPatch,
                                                        by_lists: bool) -> None:
    """Values far from zero with small differences: half precision's step (0.5 at 1,000) reorders
    neighbours, so the copy's 2k candidates miss some of the true top k. The bound leaves those rows
    to FAISS; a bound that settled every row would answer them wrongly (so this data tests it)."""
    metric = "l2"
    rng = np.random.default_rng(7)
    base = (1000 + rng.normal(0, 0.3, (6000, 16))).astype(np.float32)
    queries = (1000 + rng.normal(0, 0.3, (300, 16))).astype(np.float32)
    searchers, _, assigner = sharded_and_unsharded("IVF16,Flat", metric, base)
    query = assigner.query(prepare_vectors(queries, metric), 10, {"nprobe": 4})
    wrong = 0
    for searcher in searchers:
        half = with_half(searcher)
        assert searcher.scan_choice is not None
        searcher.scan_choice.forced = by_lists
        expected_d, expected_i = faiss_answer(searcher, query)
        distances, ids, again = copy_answer(searcher, half, query, metric)
        assert len(again) > 0
        assert np.array_equal(ids, expected_i) and np.array_equal(distances, expected_d)
        with monkeypatch.context() as patched:
            patched.setattr(HalfCopy, "_excludes_the_rest",
                            lambda self, queries, *_: np.ones(len(queries), bool))
            _, unbound_i, _ = copy_answer(searcher, half, query, metric)
        wrong += int((unbound_i != expected_i).any(axis=1).sum())
    assert wrong > 0


def test_subnormal_distances_are_not_settled_by_relative_rounding() -> None:
    """Distances among float32's subnormals round by an absolute step: a query duplicated in two
    lists, where the copy's distances all tie (they round to 0 in half precision) and float32
    rounds q0^2 up by a third. FAISS answers the copy in the list it scanned first."""
    q0 = np.float32(np.sqrt(1.5001 * 2.0 ** -149))
    q = np.array([[q0, q0]], np.float32)
    quantizer = faiss.IndexFlatL2(2)
    quantizer.add(np.array([[0, 0], [1, 1]], np.float32))
    flat = faiss.IndexIVFFlat(quantizer, 2, 2, faiss.METRIC_L2)
    flat.is_trained = True
    for number, ids, vectors in ((0, [5], q), (1, [1, 2], np.vstack([q, [[0, 0]]]))):
        ids_array, codes = np.asarray(ids, np.int64), np.ascontiguousarray(vectors, np.float32).view(np.uint8)
        flat.invlists.add_entries(number, len(ids), faiss.swig_ptr(ids_array), faiss.swig_ptr(codes))
    flat.ntotal = 3
    searcher = ShardSearcher(flat, "l2", "s0", "v")
    with_half(searcher)
    assert searcher.scan_choice is not None
    query = ShardQuery(q, 1, {"nprobe": 2}, np.array([[0, 1]], np.int64), np.zeros((1, 2), np.float32))
    for by_lists in (False, True):
        searcher.scan_choice.forced = by_lists
        assert np.array_equal(searcher.answer(query)[1], faiss_answer(searcher, query)[1])  # id 5


def test_the_copy_sits_out_while_most_rows_go_back_to_faiss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queries far from the data: no row is settled (the bound's rounding slack grows with the
    distance), so each would pay the copy's scan and FAISS's. The copy sits out, then is tried
    again every GATE_PROBE-th batch; the answers stay FAISS's throughout."""
    data = load_dataset("synthetic:8000x32")
    searchers, _, assigner = sharded_and_unsharded("IVF64,Flat", "l2", data.base)
    searcher = searchers[0]
    with_half(searcher)
    reranked: list[int] = []
    rerank = HalfCopy.rerank

    def counted(self: HalfCopy, matrix: np.ndarray, *args: object) -> tuple:
        answer = rerank(self, matrix, *args)  # type: ignore[arg-type]
        reranked.append(len(answer[2]))
        return answer

    monkeypatch.setattr(HalfCopy, "rerank", counted)
    far = assigner.query(prepare_vectors(data.queries[:64] + 1e4, "l2"), 10, {"nprobe": 7})
    batches = 2 * (GATE_PROBE + 1) + 1
    for _ in range(batches):
        distances, ids, _ = searcher.answer(far)
        expected_d, expected_i = faiss_answer(searcher, far)
        assert np.array_equal(ids, expected_i) and np.array_equal(distances, expected_d)
    assert reranked == [64, 64, 64]  # the first batch, then one in GATE_PROBE + 1: every row to FAISS
    near = assigner.query(prepare_vectors(data.queries[:64], "l2"), 10, {"nprobe": 7})
    for _ in range(GATE_PROBE * 8):  # near queries again: once their rows outweigh, the copy is back
        searcher.answer(near)
    assert searcher.half_gate.use()
