"""Fast-scan IVF indexes (`IVF...,PQ...x4fs`, which `--index auto` picks for large builds) under
filters and writes. Their lists hold codes packed in blocks: FAISS's reconstruct of a loaded one
crashes the process, and its lists refuse a removal through the hash map. So a selective filter
probes every list instead of gathering the matching rows' vectors (it crashed the shard), and a
delta whose request kills one of its rows makes its lists again (an overwrite jammed the shard's
follower, a delete of a delta point came back). Real FAISS, a real build, no Ray."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from index_build.job import build_index
from shardserve.data.datasets import load_dataset
from shardserve.index.manifest import read_manifest, read_shard_checked
from shardserve.index.partition import Partition
from shardserve.index.storage import Location
from shardserve.query.filters import check_filter
from shardserve.query.searcher import ShardSearcher
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.delta import ShardDelta
from shardserve.writes.ops import Delete, Upsert
from shardserve.writes.route import WriteRoute
from shardserve.writes.shard import ShardWithDelta
from tests.shared import DIM, write_parquet

FACTORY = "IVF16,PQ8x4fs"


@pytest.fixture(scope="module")
def fast_scan(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fast-scan")
    source = write_parquet(root / "emb")
    build_index(str(source), 1, FACTORY, str(root / "idx"), backend="local", vector_column="emb",
                id_column="doc_id", metadata_columns=["caption"])
    location = Location.parse(str(root / "idx"))
    manifest = read_manifest(location)
    return location, manifest, load_dataset(str(source), vector_column="emb", id_column="doc_id").base


def _searcher(fast_scan) -> tuple[ShardSearcher, bytes]:
    location, manifest, _ = fast_scan
    return ShardSearcher.load(location, manifest, 0, True), read_shard_checked(location, manifest.trained)


def test_a_selective_filter_on_fast_scan_lists_answers_as_faiss_with_a_selector(fast_scan) -> None:
    searcher, _ = _searcher(fast_scan)
    where = check_filter({"caption": {"$in": ["caption 5", "caption 77", "caption 4000"]}},
                         fast_scan[1].dataset.metadata_kinds)
    queries = np.random.default_rng(2).normal(size=(4, DIM)).astype(np.float32)
    distances, ids, _, matched = searcher.answer(ShardQuery(queries, 5, {"filter": where}))
    selected = searcher.selected(where)
    assert matched == 3 and len(selected) == 3
    ivf = faiss.extract_index_ivf(searcher.index)
    params = faiss.SearchParametersIVF(nprobe=int(ivf.nlist), sel=faiss.IDSelectorBatch(selected))
    expected_d, expected_i = searcher.index.search(queries, 5, params=params)
    assert np.array_equal(ids, expected_i) and np.array_equal(distances, expected_d)
    assert set(ids[:, :3].ravel().tolist()) == set(selected.tolist())


def test_a_fast_scan_delta_takes_overwrites_and_deletes_of_its_own_points(fast_scan) -> None:
    searcher, trained = _searcher(fast_scan)
    delta = ShardDelta(searcher, 0, WriteRoute(Partition(1)), trained)
    view = ShardWithDelta(searcher, delta)
    base = fast_scan[2]
    first, moved = base[100].copy(), base[5000].copy()  # copies of base points: the codes they get
    new = 1  # below every base id: PQ 4-bit codes tie often here, and ties go to the lower id

    def top(vector: np.ndarray) -> list[int]:
        return view.answer(ShardQuery(vector[None], 10, {"nprobe": 16}))[1][0].tolist()

    assert delta.apply(1, [Upsert(new, first, None), Upsert(new + 1, first, None)])
    assert {new, new + 1} <= set(top(first))
    assert delta.apply(2, [Upsert(new, moved, None)])  # an overwrite of a delta point: it moves
    assert new in top(moved) and new not in top(first) and new + 1 in top(first)
    assert delta.apply(3, [Delete(new)])  # a delete of one: gone, the other kept
    assert new not in top(moved) and new not in top(first) and new + 1 in top(first)
    assert delta.position == 3 and delta.rows == 1
    ids, _, _ = delta.points()
    assert ids.tolist() == [new + 1]
