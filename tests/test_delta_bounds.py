"""A shard's delta costs what a write touches, not what the delta holds: overwriting or deleting a
point of a flat delta (Flat, HNSW and refined shards) compacts nothing (FAISS's remove_ids on an
IndexIDMap2 moves every row after it), a write costs the next filtered search its own rows' metadata
only, and the per-filter matches the delta keeps are bounded by bytes. Answers stay brute force's
throughout. Real FAISS, seeded, no Ray."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass

import faiss
import numpy as np
import pyarrow as pa
import pytest

import shardserve.writes.delta as delta_module
from shardserve.data.datasets import load_dataset
from shardserve.index.indexes import add_to_copy, prepare_vectors, train_empty_index
from shardserve.index.metadata import ID, MetadataTable, Postings, build_postings
from shardserve.index.partition import Partition
from shardserve.query.filters import check_filter
from shardserve.query.searcher import ShardSearcher
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.delta import ShardDelta
from shardserve.writes.ops import Delete, Op, Upsert
from shardserve.writes.route import WriteRoute
from shardserve.writes.shard import ShardWithDelta

GROUPS = 20
KINDS = {"group": "int32"}


@dataclass
class Flat:
    """One Flat shard (every write's home) with its delta, and the dataset it was built from."""

    shard: ShardWithDelta
    base: np.ndarray
    queries: np.ndarray
    metric: str

    @property
    def delta(self) -> ShardDelta:
        return self.shard.delta


def _flat(metric: str = "l2", rows: int = 3000) -> Flat:
    data = load_dataset(f"synthetic:{rows}x16")
    base = prepare_vectors(data.base, metric)
    ids = np.arange(len(base), dtype=np.int64)
    searcher = ShardSearcher(add_to_copy(train_empty_index("Flat", metric, base, seed=3), base, ids),
                             metric, "s0", "v")
    table = pa.table({ID: pa.array(ids, pa.int64()), "group": pa.array(ids % GROUPS, pa.int32())})
    searcher.metadata = MetadataTable(table, Postings(build_postings(table.drop_columns([ID]))))
    delta = ShardDelta(searcher, 0, WriteRoute(Partition(1)), max_rows=100_000)
    return Flat(ShardWithDelta(searcher, delta), base, prepare_vectors(data.queries[:100], metric), metric)


class Live:
    """Brute force's side: every live point's latest vector and group."""

    def __init__(self, base: np.ndarray):
        self.points = {i: (base[i], i % GROUPS) for i in range(len(base))}
        self.written: set[int] = set()  # the live ids last upserted (not base rows as built)

    def apply(self, ops: list[Op]) -> None:
        for op in ops:
            self.points.pop(op.id, None)
            self.written.discard(op.id)
            if isinstance(op, Upsert):
                self.points[op.id] = (op.vector, op.metadata["group"])  # type: ignore[index]
                self.written.add(op.id)

    def search(self, queries: np.ndarray, k: int, metric: str, groups: set[int] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """An IndexFlat of the live points (those in `groups`), searched."""
        kept = sorted(i for i, (_, g) in self.points.items() if groups is None or g in groups)
        kind = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
        flat = faiss.IndexFlat(queries.shape[1], kind)
        flat.add(np.stack([self.points[i][0] for i in kept]))
        distances, rows = flat.search(queries, k)
        return distances, np.where(rows >= 0, np.array(kept, np.int64)[np.maximum(rows, 0)], -1)


def _requests(base: np.ndarray, rng: np.random.Generator, operations: int, written: int
              ) -> Iterator[list[Op]]:
    """Requests of 1-8 operations on distinct ids, most of them on a pool of `written` ids (so a
    point is overwritten again and again), some on base ids: upserts, deletes, re-upserts."""
    done = 0
    while done < operations:
        ops: list[Op] = []
        used: set[int] = set()
        for _ in range(int(rng.integers(1, 9))):
            id_ = int(rng.integers(len(base))) if rng.random() < 0.2 else \
                1_000_000 + int(rng.integers(written))
            if id_ in used:
                continue
            used.add(id_)
            if rng.random() < 0.25:
                ops.append(Delete(id_))
            else:
                near = base[int(rng.integers(len(base)))]
                vector = (near + 0.05 * rng.normal(size=base.shape[1])).astype(np.float32)
                ops.append(Upsert(id_, vector, {"group": int(rng.integers(GROUPS))}))
        done += len(ops)
        yield ops


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_overwrites_and_deletes_in_a_flat_delta_answer_as_brute_force(metric: str) -> None:
    """20,000 operations, most on 1,500 ids written again and again (dead rows pile up and are
    reclaimed many times): at every checkpoint the shard answers as an IndexFlat of the live points,
    unfiltered and under filters kept from checkpoint to checkpoint (a selective one: compared one
    by one; a broad one: the index's own search), each id once, with its latest vector."""
    setup = _flat(metric)
    live = Live(setup.base)
    selective = check_filter({"group": {"$in": [3, 17]}}, KINDS)
    broad = check_filter({"group": {"$lt": 12}}, KINDS)
    checks: list[tuple[str | None, set[int] | None]] = [(None, None), (selective, {3, 17}),
                                                         (broad, set(range(12)))]
    rng = np.random.default_rng(11)
    for position, ops in enumerate(_requests(setup.base, rng, 20_000, 1500), 1):
        assert setup.delta.apply(position, ops)
        live.apply(ops)
        if position % 400:
            continue
        for where, groups in checks:
            params = {} if where is None else {"filter": where}
            answer = setup.shard.answer(ShardQuery(setup.queries, 10, params))
            distances, ids = live.search(setup.queries, 10, metric, groups)
            assert np.array_equal(answer[1], ids)
            assert np.allclose(answer[0], distances, rtol=1e-5, atol=1e-4)
            if where is not None and groups is not None:
                matching = sorted(i for i, (_, g) in live.points.items() if g in groups)
                assert answer[3] == len(matching)
                assert sorted(setup.shard.ids_matching(where)[0].tolist()) == matching
    ids, vectors, metadata = setup.delta.points()
    assert sorted(ids.tolist()) == sorted(live.written) and setup.delta.rows == len(live.written)
    for id_, vector, meta in zip(ids.tolist(), vectors, metadata, strict=True):
        assert np.array_equal(vector, live.points[id_][0]) and meta == {"group": live.points[id_][1]}


def test_an_overwrite_in_a_flat_delta_moves_no_other_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """3,000 one-point overwrites of a 5,000-point flat delta: FAISS's remove_ids (which compacts
    every row after the one removed) is never called, and the rows given to FAISS stay a few per
    overwrite, reclaiming the dead rows included."""
    setup = _flat()
    rng = np.random.default_rng(5)
    vectors = rng.normal(size=(5000, 16)).astype(np.float32)
    setup.delta.apply(1, [Upsert(1_000_000 + i, vectors[i], {"group": i % GROUPS}) for i in range(5000)])
    kind = type(setup.delta.index)
    removed: list[int] = []
    added: list[int] = []
    for name, tally, rows_of in (("remove_ids", removed, lambda args: 1),
                                 ("add", added, lambda args: len(args[0])),
                                 ("add_with_ids", added, lambda args: len(args[0]))):
        original = getattr(kind, name)

        def spy(self, *args, _original=original, _tally=tally, _rows_of=rows_of):  # type: ignore[no-untyped-def]
            _tally.append(_rows_of(args))
            return _original(self, *args)

        monkeypatch.setattr(kind, name, spy)
    for position in range(2, 3002):
        id_ = 1_000_000 + int(rng.integers(5000))
        setup.delta.apply(position, [Upsert(id_, rng.normal(size=16).astype(np.float32), {"group": 1})])
    assert not removed
    assert sum(added) <= 3 * 3000
    assert setup.delta.rows == 5000


class CountingDict(dict):
    """Metadata that counts how often the delta reads it (class-wide)."""

    reads = 0

    def get(self, *args):  # type: ignore[no-untyped-def,override]
        CountingDict.reads += 1
        return super().get(*args)

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        CountingDict.reads += 1
        return super().__getitem__(key)


def test_a_write_costs_the_next_filtered_search_its_own_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5,000-point delta, two filters searched; then one point overwritten: the next searches
    under both filters read that point's metadata only, and compare that row only, and answer with
    its new metadata."""
    setup = _flat()
    rng = np.random.default_rng(2)
    vectors = rng.normal(size=(5000, 16)).astype(np.float32)
    setup.delta.apply(1, [Upsert(1_000_000 + i, vectors[i], CountingDict(group=i % GROUPS))
                          for i in range(5000)])
    filters = [check_filter({"group": 3}, KINDS), check_filter({"group": {"$gte": 10}}, KINDS)]
    for where in filters:
        setup.shard.answer(ShardQuery(setup.queries, 10, {"filter": where}))
    compared: list[int] = []
    real = delta_module.matching

    def spy(where: str, table: pa.Table, ids: np.ndarray, *args):  # type: ignore[no-untyped-def]
        compared.append(table.num_rows)
        return real(where, table, ids, *args)

    monkeypatch.setattr(delta_module, "matching", spy)
    CountingDict.reads = 0
    setup.delta.apply(2, [Upsert(1_000_003, vectors[3], CountingDict(group=11))])  # was group 3
    answers = [setup.shard.answer(ShardQuery(vectors[3:4], 10, {"filter": where})) for where in filters]
    assert CountingDict.reads <= 2  # the one written point's group, read once
    assert sum(compared) <= 2  # its row, once per filter
    assert 1_000_003 not in answers[0][1] and answers[0][3] == 3000 // GROUPS + 5000 // GROUPS - 1
    assert answers[1][1][0, 0] == 1_000_003 and answers[1][3] == 10 * (3000 + 5000) // GROUPS + 1


def test_the_delta_s_filter_matches_are_bounded_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """300 distinct filters, each matching every one of a 20,000-point delta's points (160 kB of
    ids each): what the delta keeps of them stays within its bound (here 1 MB)."""
    monkeypatch.setattr(delta_module, "MATCHED_BYTES", 1 << 20, raising=False)
    setup = _flat()
    rng = np.random.default_rng(4)
    vectors = rng.normal(size=(20_000, 16)).astype(np.float32)
    for position, start in enumerate(range(0, 20_000, 1000), 1):
        setup.delta.apply(position, [Upsert(1_000_000 + i, vectors[i], {"group": i % GROUPS})
                                     for i in range(start, start + 1000)])
    wheres = [check_filter({"$id": {"$nin": [int(n)]}}, KINDS) for n in range(300)]
    with setup.delta.lock:
        assert len(setup.delta.matching(wheres[0])) == 20_000  # the first: warms what every filter shares
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for where in wheres[1:]:
                assert len(setup.delta.matching(where)) == 20_000
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    assert held <= (1 << 20) + (512 << 10)
