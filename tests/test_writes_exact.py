"""Online writes are exact: after a mixed sequence of >= 10,000 upserts (new ids, overwrites, some
moving an id to another shard) and deletes, written to the real log and applied by every shard's
delta in log order, the merged sharded answers equal one unsharded FAISS index that applied the
same operations in the same order (IndexIDMap2 over Flat, or the IVF of the same quantizer,
modified with remove_ids / add_with_ids). Deleted ids never come back, filtered or not.
Real FAISS, real SQLite, seeded, no Ray."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pytest

from shardserve.data.datasets import load_dataset
from shardserve.index.indexes import index_to_bytes, prepare_vectors
from shardserve.index.metadata import ID, MetadataTable, Postings, build_postings
from shardserve.index.partition import BY_LISTS, BY_ROWS, Partition
from shardserve.query.filters import check_filter
from shardserve.query.merge import merge_topk
from shardserve.query.searcher import ShardSearcher
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.delta import DeltaFull, ShardDelta
from shardserve.writes.log import WriteLog
from shardserve.writes.ops import Delete, Op, Upsert
from shardserve.writes.route import WriteRoute, splitmix64
from shardserve.writes.shard import ShardWithDelta
from shardserve.writes.tombstones import stored_ids
from tests.shared import sharded_and_unsharded

GROUPS = 20
KINDS = {"group": "int32"}
OPERATIONS = 10_500


def _metadata(ids: np.ndarray, groups: np.ndarray) -> MetadataTable:
    order = np.argsort(ids)
    table = pa.table({ID: pa.array(ids[order], pa.int64()), "group": pa.array(groups[order], pa.int32())})
    return MetadataTable(table, Postings(build_postings(table.drop_columns([ID]))))


def _requests(base: np.ndarray, rng: np.random.Generator) -> list[list[Op]]:
    """Requests of 1-16 operations on distinct ids: new ids (small and past 2^62), overwrites of
    live ids (base or written) with a vector near another base row (often another IVF list, so
    another shard), deletes of live ids, deletes of ids not there, and re-upserts of deleted ids."""
    live = set(range(len(base)))
    deleted: set[int] = set()
    fresh = iter(range(10_000_000, 20_000_000))
    requests: list[list[Op]] = []
    count = 0
    while count < OPERATIONS:
        ops: list[Op] = []
        used: set[int] = set()
        for _ in range(int(rng.integers(1, 17))):
            roll = rng.random()
            if roll < 0.3 or not live:
                id_ = next(fresh) if rng.random() < 0.8 else 2**62 + next(fresh)
            elif roll < 0.65:
                id_ = int(rng.choice(list(live)))
            elif roll < 0.85:
                id_ = int(rng.choice(list(live)))
                if id_ not in used:
                    ops.append(Delete(id_))
                    used.add(id_)
                    live.discard(id_)
                    deleted.add(id_)
                continue
            elif roll < 0.9:
                id_ = next(fresh)  # a delete of an id never written: nothing to do, anywhere
                ops.append(Delete(id_))
                used.add(id_)
                continue
            else:
                if not deleted:
                    continue
                id_ = int(rng.choice(sorted(deleted)))  # written again after its delete
            if id_ in used:
                continue
            near = base[int(rng.integers(len(base)))]
            vector = (near + 0.05 * rng.normal(size=base.shape[1])).astype(np.float32)
            ops.append(Upsert(id_, vector, {"group": int(rng.integers(GROUPS))}))
            used.add(id_)
            live.add(id_)
            deleted.discard(id_)
        if ops:
            requests.append(ops)
            count += len(ops)
    return requests


class Unsharded:
    """The reference: one FAISS index with every point, modified request by request."""

    def __init__(self, searcher: ShardSearcher, groups: dict[int, int]):
        self.index, self.metric = searcher.index, searcher.metric
        self.vectors: dict[int, np.ndarray] = {}
        self.groups = dict(groups)
        self.deleted: set[int] = set()

    def apply(self, ops: list[Op]) -> None:
        there = np.array([op.id for op in ops if op.id in self.groups], np.int64)
        if len(there) and self.index is not None:
            self.index.remove_ids(faiss.IDSelectorArray(there))
        upserts = [op for op in ops if isinstance(op, Upsert)]
        for op in ops:
            self.groups.pop(op.id, None)
            if isinstance(op, Delete):
                self.deleted.add(op.id)
        for op in upserts:
            self.deleted.discard(op.id)
            self.groups[op.id] = op.metadata["group"]  # type: ignore[index]
            self.vectors[op.id] = op.vector
        if upserts and self.index is not None:
            self.index.add_with_ids(np.stack([op.vector for op in upserts]),
                                    np.array([op.id for op in upserts], np.int64))

    def searcher(self) -> ShardSearcher:
        """As it stands now, with its metadata: a new searcher (no cache from before)."""
        searcher = ShardSearcher(self.index, self.metric, "all", "v")
        ids = np.array(sorted(self.groups), np.int64)
        searcher.metadata = _metadata(ids, np.array([self.groups[i] for i in ids.tolist()]))
        return searcher


def _setup(factory: str, by: str, tmp_path: Path, metric: str = "l2") -> tuple:
    data = load_dataset("synthetic:6000x32")
    searchers, unsharded, assigner = sharded_and_unsharded(factory, metric, data.base, by=by)
    trained = None if assigner is None else index_to_bytes(assigner.ivf)
    base = prepare_vectors(data.base, metric)
    partition = Partition.plan(trained, base, 4) if by == BY_LISTS else Partition(4)  # type: ignore[arg-type]
    route = WriteRoute(partition, assigner)
    shards = []
    for number, searcher in enumerate(searchers):
        ids = stored_ids(searcher.index)
        if by == BY_LISTS:  # the build dealt these rows by the rule writes follow
            assert (route.shard_of(ids, base[ids]) == number).all()
        searcher.metadata = _metadata(ids, ids % GROUPS)
        shards.append(ShardWithDelta(searcher, ShardDelta(searcher, number, route, trained, max_rows=50_000)))
    reference = Unsharded(unsharded, {i: i % GROUPS for i in range(len(base))})
    return data, base, shards, reference, assigner, WriteLog(tmp_path / "log.sqlite")


def _sharded(shards: list[ShardWithDelta], query: ShardQuery) -> tuple[np.ndarray, np.ndarray, int]:
    answers = [shard.answer(query) for shard in shards]
    ip = shards[0].searcher.metric != "l2"
    distances, ids = merge_topk([a[0] for a in answers], [a[1] for a in answers], query.k, ip)
    return distances, ids, sum(a[3] for a in answers) if "filter" in query.params else 0


def _query(assigner, queries: np.ndarray, params: dict) -> ShardQuery:  # type: ignore[no-untyped-def]
    return ShardQuery(queries, 10, params) if assigner is None else assigner.query(queries, 10, params)


def _same(got: tuple, expected: tuple, exact_distances: bool) -> None:
    (d, i), (ed, ei) = got[:2], expected[:2]
    assert np.array_equal(i, ei)
    if exact_distances:
        assert np.array_equal(d, ed)
    else:
        assert np.allclose(d, ed, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("factory", "by", "metric"), [
    ("Flat", BY_ROWS, "l2"), ("IVF64,Flat", BY_LISTS, "l2"), ("IVF64,Flat", BY_LISTS, "ip")])
def test_sharded_writes_equal_the_unsharded_index(factory: str, by: str, metric: str, tmp_path: Path) -> None:
    data, base, shards, reference, assigner, log = _setup(factory, by, tmp_path, metric)
    rng = np.random.default_rng(43)
    requests = _requests(base, rng)
    assert sum(len(ops) for ops in requests) >= 10_000
    queries = prepare_vectors(data.queries[:200], metric)
    ivf = assigner is not None
    nprobes = (1, 4, 16) if ivf else (None,)
    selective = check_filter({"group": {"$in": [3, 17]}}, KINDS)  # 10 %: every side compares exactly
    broad = check_filter({"group": {"$lt": 12}}, KINDS)  # 60 %: at nprobe 16, every list (exhaustive)
    moved = 0
    route = shards[0].delta.route
    home = {int(i): n for n, shard in enumerate(shards) for i in stored_ids(shard.searcher.index)}
    checkpoints = set(range(0, len(requests), len(requests) // 5)) | {len(requests) - 1}
    for number, ops in enumerate(requests):
        position = log.append(ops)
        assert position == number + 1
        for read_position, read_ops in log.read(position - 1, limit=1):
            for shard in shards:
                assert shard.delta.apply(read_position, read_ops)
            reference.apply(read_ops)
        for op in ops:  # an overwrite whose new home is another shard moves the point
            old = home.pop(op.id, None)
            if isinstance(op, Upsert):
                home[op.id] = int(route.shard_of(np.array([op.id]), op.vector[None])[0])
                moved += old is not None and old != home[op.id]
        if number not in checkpoints:
            continue
        unsharded = reference.searcher()
        for nprobe in nprobes:
            params = {} if nprobe is None else {"nprobe": nprobe}
            for rows in (queries, queries[:8]):  # list by list (>= 64 rows), and query by query
                query = _query(assigner, rows, params)
                _same(_sharded(shards, query), unsharded.answer(query), exact_distances=ivf)
        for where, nprobe in ((selective, 4), (broad, 16)):
            params = {"filter": where, **({"nprobe": nprobe} if ivf else {})}
            query = _query(assigner, queries, params)
            got = _sharded(shards, query)
            expected = unsharded.answer_filtered(query)
            _same(got, expected, exact_distances=False)
            assert got[2] == expected[3] == sum(1 for g in reference.groups.values()
                                                if (g in (3, 17) if where == selective else g < 12))
            # a delete by filter's ids: every live point whose latest metadata matches, once
            found = np.concatenate([shard.ids_matching(where)[0] for shard in shards])
            assert {shard.ids_matching(where)[1] for shard in shards} == {position}  # found at one position
            assert sorted(found.tolist()) == sorted(i for i, g in reference.groups.items()
                                                    if (g in (3, 17) if where == selective else g < 12))
    # every shard applied the same log; a replay changes nothing
    assert all(shard.position == len(requests) for shard in shards)
    assert not any(shard.delta.apply(p, ops) for shard in shards for p, ops in log.read(0, limit=5))
    # the delta holds each point once: the shards' live points are exactly the reference's
    held = [int(i) for s in shards for i in s.delta.points()[0]]
    assert len(held) == len(set(held))
    base_live = [int(i) for s in shards for i in stored_ids(s.searcher.index)
                 if int(i) not in s.delta.tombstones]
    assert sorted(held + base_live) == sorted(reference.groups)
    assert moved > 100
    # a delete by filter: the matching ids, deleted by id in one request, and none match again
    doomed = np.concatenate([shard.ids_matching(selective)[0] for shard in shards])
    assert len(doomed)
    position = log.append([Delete(int(i)) for i in doomed])
    for shard in shards:
        assert shard.delta.apply(position, log.read(position - 1, limit=1)[0][1])
    reference.apply([Delete(int(i)) for i in doomed])
    assert not any(len(shard.ids_matching(selective)[0]) for shard in shards)
    query = _query(assigner, queries, {"filter": selective, **({"nprobe": 16} if ivf else {})})
    assert (_sharded(shards, query)[1] == -1).all()
    _deleted_never_come_back(shards, reference, assigner)


def _deleted_never_come_back(shards: list[ShardWithDelta], reference: Unsharded, assigner) -> None:  # type: ignore[no-untyped-def]
    """Each deleted id, searched with its own last vector (or its base row), unfiltered, under its
    own group and under an `$id` filter naming it: never answered, and no filter matches it."""
    gone = np.array(sorted(reference.deleted), np.int64)
    assert len(gone) > 500
    base = {int(i): v for s in shards for i, v in zip(stored_ids(s.searcher.index).tolist(),
                                                     _base_vectors(s.searcher), strict=True)}
    own = np.stack([reference.vectors.get(int(i), base.get(int(i))) for i in gone[:300]])
    hunted = check_filter({"$id": {"$in": gone.tolist()[:4096]}}, KINDS)
    for params in ({"nprobe": 64}, {"nprobe": 64, "filter": hunted},
                   {"nprobe": 64, "filter": check_filter({"group": {"$in": [0, 1, 2, 3, 4]}}, KINDS)}):
        if assigner is None:
            params.pop("nprobe")
        query = _query(assigner, own, params)
        _, ids, matched = _sharded(shards, query)
        assert not set(ids.ravel().tolist()) & set(gone.tolist())
        if params.get("filter") == hunted:
            assert matched == 0 and (ids == -1).all()
    for shard in shards:
        assert all(row is None for row in shard.lookup(gone.tolist(), ["group"]))


def _base_vectors(searcher: ShardSearcher) -> np.ndarray:
    ids = stored_ids(searcher.index)
    if searcher.ivf is not None:
        return searcher._vectors(ids)
    return searcher.index.reconstruct_batch(ids)


def test_one_point_s_home_is_the_vectorised_rule_s() -> None:
    """A replica routes a one-point request without numpy (home_of): the same shard as shard_of,
    over ids spread to the top of int64."""
    rng = np.random.default_rng(3)
    ids = np.concatenate([np.arange(1000), rng.integers(0, np.iinfo(np.int64).max, 5000, dtype=np.int64),
                          [np.iinfo(np.int64).max]])
    for shards in (1, 3, 4, 7):
        route = WriteRoute(Partition(shards))
        assert route.by_id
        assert [route.home_of(int(i)) for i in ids] == route.shard_of(ids, np.zeros((len(ids), 2))).tolist()
    assert splitmix64(ids[:1]).dtype == np.uint64


def test_a_full_delta_refuses_the_whole_request(tmp_path: Path) -> None:
    data, base, shards, _, _, _ = _setup("Flat", BY_ROWS, tmp_path)
    delta = ShardDelta(shards[0].searcher, 0, shards[0].delta.route, max_rows=10)
    mine = [i for i in range(10**6, 10**6 + 400)
            if delta.route.shard_of(np.array([i]), base[:1])[0] == 0][:12]
    delta.apply(1, [Upsert(i, base[n], {"group": 1}) for n, i in enumerate(mine[:8])])
    with pytest.raises(DeltaFull):
        delta.apply(2, [Delete(mine[0]), *[Upsert(i, base[0], None) for i in mine[8:11]]])
    assert delta.position == 1 and delta.rows == 8 and 0 not in delta.tombstones  # nothing applied
    delta.apply(2, [Delete(mine[0]), Delete(4), Delete(5), *[Upsert(i, base[0], None) for i in mine[8:10]]])
    assert delta.rows == 9 and 4 in delta.tombstones and 5 not in delta.tombstones  # 5: shard 1's
    assert delta.apply(3, [Upsert(mine[11], base[1], None)], bounded=False)  # a replay is held anyway
    assert delta.room() == 0 and not delta.apply(3, [Delete(mine[1])])  # position 3 was applied


def test_searches_during_writes_answer_each_id_once(tmp_path: Path) -> None:
    """A thread overwrites base points (each a copy of its old vector, so base and delta copies tie
    as nearest) while searches run: each answer sees one log position, so no id twice in a row."""
    import threading

    data, base, shards, _, assigner, _ = _setup("IVF64,Flat", BY_LISTS, tmp_path)
    shard = shards[0]
    ids = stored_ids(shard.searcher.index)[:600]
    vectors = shard.searcher._vectors(ids)
    done = threading.Event()

    def write() -> None:
        for position, start in enumerate(range(0, len(ids), 3), 1):
            part = slice(start, start + 3)
            shard.delta.apply(position, [Upsert(int(i), v, {"group": 1}) for i, v in
                                         zip(ids[part], vectors[part], strict=True)], bounded=False)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    searches = 0
    group = check_filter({"group": 1}, KINDS)
    while not done.is_set() or searches < 5:
        plain = assigner.query(vectors[:64], 10, {"nprobe": 4})
        filtered = assigner.query(vectors[:64], 10, {"nprobe": 4, "filter": group})
        for answer in (shard.answer(plain)[1], shard.answer(filtered)[1]):
            for row in answer:
                real = row[row >= 0]
                assert len(set(real.tolist())) == len(real)
        searches += 1
    writer.join()
    assert shard.delta.rows > 0 and searches >= 5


@pytest.mark.parametrize(("factory", "by"), [("IVF64,Flat", BY_LISTS), ("Flat", BY_ROWS)])
def test_each_snapshot_excludes_exactly_the_tombstones_so_far(factory: str, by: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots built one on another (IVF: the settled set rebuilt often, SETTLED_MIN lowered) keep
    every base row but the tombstones hidden up to then, and earlier snapshots stay as they were."""
    import shardserve.writes.tombstones as tombstones

    monkeypatch.setattr(tombstones, "SETTLED_MIN", 4)
    _, _, shards, _, _, _ = _setup(factory, by, tmp_path)
    base = shards[0].searcher.index
    stones = tombstones.Tombstones(base)
    rows = stored_ids(base)
    rng = np.random.default_rng(5)
    taken: list[tuple] = []
    for _ in range(30):
        for id_ in rng.choice(rows, int(rng.integers(1, 20))).tolist():
            stones.hide(int(id_))
        snapshot = stones.exclusion()
        assert snapshot is not None
        taken.append((snapshot, set(int(i) for i in snapshot.ids)))
    assert not stones.hide(10**12)  # not in the base: nothing to hide
    for snapshot, hidden in taken:
        keys = rows if by == BY_LISTS else np.arange(len(rows))  # IVF: ids; IndexIDMap2: inner rows
        kept = [bool(snapshot.selector.is_member(int(key))) for key in keys]
        assert kept == [int(i) not in hidden for i in rows]


@pytest.mark.parametrize(("factory", "by"), [("HNSW16", BY_ROWS), ("IVF64,SQ8", BY_LISTS),
                                             ("IVF64,PQ8x4fs,RFlat", BY_ROWS)])
def test_other_index_kinds_find_writes_and_never_deleted_ids(factory: str, by: str, tmp_path: Path) -> None:
    """Kinds whose sharded answers are not the unsharded ones even without writes (graphs, 4-bit
    codes) or that were not checked above: an upserted point is found with its own vector, a deleted
    or overwritten base copy never comes back, each id at most once."""
    data, base, shards, reference, assigner, _ = _setup(factory, by, tmp_path)
    reference.index = None  # HNSW and refined indexes have no remove_ids: the live ids are enough here
    requests = _requests(base, np.random.default_rng(8))[:300]
    for position, ops in enumerate(requests, 1):
        for shard in shards:
            shard.delta.apply(position, ops)
        reference.apply(ops)
    upserted = [op for ops in requests for op in ops if isinstance(op, Upsert)]
    latest = {op.id: op.vector for op in upserted if op.id in reference.groups}
    ids = np.array(sorted(latest)[:200], np.int64)
    own = np.stack([latest[int(i)] for i in ids])
    params = {"efSearch": 128} if factory.startswith("HNSW") else {"nprobe": 64} if assigner else {}
    if factory.endswith("RFlat"):
        params = {"nprobe": 64}
    _, found, _ = _sharded(shards, _query(assigner, own, params))
    assert np.mean([i in row for i, row in zip(ids.tolist(), found.tolist(), strict=True)]) >= 0.97
    assert not set(found.ravel().tolist()) & reference.deleted
    for row in found:
        assert len(set(row[row >= 0].tolist())) == len(row[row >= 0])
