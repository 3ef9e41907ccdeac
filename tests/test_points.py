"""The point API below HTTP: a shard replica's live ids, counts and points (ShardWrites) against a
plain reference of what was written, on a flat shard and an IVF shard, through random upserts
(new ids and overwrites of base rows), deletes and filters; and the router's parsing and merging
of pages and points (shardserve.writes.points). Real SQLite logs and FAISS indexes, no Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest

from index_build.job import build_index
from shardserve.index.manifest import Manifest, read_manifest
from shardserve.index.storage import Location
from shardserve.query.api import ApiError, ParsedQuery
from shardserve.query.merge import QueryResult
from shardserve.query.render import windowed
from shardserve.writes.log import WriteLog
from shardserve.writes.ops import Delete, Upsert
from shardserve.writes.points import page, parse_count, parse_points, parse_scroll, picked, rendered
from tests.shared import DIM, ROWS, source_id, write_parquet
from tests.test_log_positions import replica as replica_of


@pytest.fixture(scope="module", params=["Flat", "IVF8,Flat"])
def index(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Location, Manifest]:
    root = tmp_path_factory.mktemp("points")
    build_index(str(write_parquet(root / "emb")), 1, request.param, str(root / "idx"), backend="local",
                vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    location = Location.parse(str(root / "idx"))
    return location, read_manifest(location)


def test_live_ids_counts_and_points_follow_every_write(index, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    base_ids = source_id(np.arange(ROWS))
    held: dict[int, tuple[np.ndarray | None, str]] = {int(i): (None, f"caption {r}")
                                                      for r, i in enumerate(base_ids)}
    log_path = tmp_path / "log.sqlite"
    writer = WriteLog(log_path)
    replica = replica_of(index, log_path)

    def check() -> None:
        live, _ = replica.live_ids()
        assert live.tolist() == sorted(held)
        ordered = sorted(held)
        for _page in range(4):  # pages from random cursors, of random sizes, as a scroll reads them
            after = None if rng.random() < 0.2 else int(rng.choice(ordered + [1 << 62]))
            limit = int(rng.integers(1, 3000))
            past = [i for i in ordered if after is None or i > after]
            assert replica.page(after, limit).tolist() == past[:limit]
            new, where = [i for i in past if held[i][1] == "new"], orjson.dumps({"caption": "new"}).decode()
            assert replica.page(after, limit, where).tolist() == new[:limit]
        for caption in ("new", "caption 7", "gone"):
            where = orjson.dumps({"caption": caption}).decode()
            wanted = sorted(i for i, (_, c) in held.items() if c == caption)
            assert replica.live_ids(where)[0].tolist() == wanted
        unknown = rng.integers(1 << 40, 1 << 41, 5)
        asked = [int(i) for i in rng.choice(list(held), 20)] + [int(i) for i in unknown]
        found, matrix, _ = replica.points(asked, ["caption"], True)
        assert matrix is not None
        for slot, id_ in enumerate(asked):
            if id_ not in held:
                assert found[slot] is None
                continue
            vector, caption = held[id_]
            assert found[slot] == {"caption": caption}
            if vector is not None:  # written: as written; a base row: as the index stores it
                assert np.array_equal(matrix[slot], vector)
            else:
                assert matrix[slot][0] == float(np.flatnonzero(base_ids == id_)[0])  # component 0: its row

    check()  # nothing written yet: the base alone
    fresh = 1 << 50
    for _ in range(12):
        ops: list = []
        for _op in range(int(rng.integers(1, 30))):
            roll = rng.random()
            if roll < 0.4:
                fresh += 1
                ops.append(Upsert(fresh, rng.normal(size=DIM).astype(np.float32), {"caption": "new"}))
            elif roll < 0.7:  # an overwrite of a base row or an earlier write
                id_ = int(rng.choice(list(held)))
                ops.append(Upsert(id_, rng.normal(size=DIM).astype(np.float32), {"caption": "caption 7"}))
            else:
                ops.append(Delete(int(rng.choice(list(held)))))
        writer.append(ops)
        for op in ops:
            if isinstance(op, Upsert):
                held[op.id] = (op.vector, op.metadata["caption"])
            else:
                held.pop(op.id, None)
        check()
        assert replica.live_rows() == len(held)
    writer.close()


def _manifest(kinds: dict[str, str]) -> Manifest:
    from shardserve.index.manifest import DatasetInfo, ShardEntry

    dataset = DatasetInfo.model_construct(metadata_kinds=kinds, metadata_columns=list(kinds))
    shard = ShardEntry(name="shard-000", path="shard-000.faiss", sha256="0" * 64, bytes=1, num_vectors=10)
    return Manifest.model_construct(dim=4, metric="l2", dataset=dataset, shards=[shard])


@pytest.mark.parametrize("route, body, field", [
    ("points", b"[]", "body"), ("points", b"{}", "ids"), ("points", b'{"ids": [1.5]}', "ids"),
    ("points", b'{"ids": [true]}', "ids"), ("points", b'{"ids": [9223372036854775808]}', "ids"),
    ("points", b'{"ids": [1], "extra": 1}', "extra"),
    ("points", b'{"ids": [1], "include": "label"}', "include"),
    ("scroll", b'{"limit": 1001}', "limit"), ("scroll", b'{"after": -1}', "after"),
    ("scroll", b'{"filter": {"label": {"$gt": "x"}}}', "filter"), ("count", b'{"filter": 3}', "filter"),
    ("count", b"not json", "body"),
])
def test_point_requests_are_checked_before_any_shard_sees_them(route: str, body: bytes, field: str) -> None:
    parse = {"points": parse_points, "scroll": parse_scroll, "count": parse_count}[route]
    with pytest.raises(ApiError) as refused:
        parse(body, _manifest({"label": "number"}))
    assert (refused.value.status, refused.value.field) == (422, field)


def test_point_requests_defaults_and_bounds() -> None:
    manifest = _manifest({"label": "number", "name": "string"})
    asked = parse_points(b'{"ids": [3, 1, 3]}', manifest)
    assert asked.ids == (3, 1) and asked.include == ("label", "name") and not asked.vectors
    assert parse_points(b'{"ids": [1], "include": []}', manifest).include == ()
    with pytest.raises(ApiError):
        parse_points(orjson.dumps({"ids": list(range(11))}), manifest, max_page=10)
    scroll = parse_scroll(b"", manifest)
    assert (scroll.after, scroll.limit, scroll.filter) == (None, 100, None)
    assert parse_count(b"", manifest) is None and parse_count(b'{"filter": {"label": 2}}', manifest)


def test_pages_merge_distinct_in_order_and_say_when_more_follow() -> None:
    ids, more = page([np.array([1, 4, 9]), np.array([2, 4, 5])], 3)
    assert ids.tolist() == [1, 2, 4] and more  # 4 on two shards (moving) counts once; 5 and 9 follow
    ids, more = page([np.array([1]), np.array([2])], 3)
    assert ids.tolist() == [1, 2] and not more
    ids, more = page([np.array([1, 2, 3]), np.array([], np.int64)], 3)
    assert ids.tolist() == [1, 2, 3] and not more  # limit + 1 asked of each: a shard with 3 has no more


def test_a_get_keeps_the_copy_of_the_shard_that_applied_more() -> None:
    old = ([{"c": "old"}, None], np.ones((2, 2), np.float32), 7)
    new = ([{"c": "new"}, None], np.full((2, 2), 2, np.float32), 9)
    found, vectors = picked([new, old], 2)
    assert found == [{"c": "new"}, None] and vectors[0].tolist() == [2.0, 2.0] and vectors[1] is None
    assert rendered([5, 6], found, vectors, with_vectors=False) == [{"id": 5, "metadata": {"c": "new"}}]


@pytest.mark.parametrize("ip", [False, True])
def test_offset_and_score_threshold_cut_the_merged_hits(ip: bool) -> None:
    distances = np.array([[0.9, 0.8, 0.5, 0.1]] if ip else [[0.1, 0.5, 0.8, 0.9]], np.float32)
    result = QueryResult(distances, np.array([[10, 11, 12, 13]]), 1, 1, 0.0, 0.0, 1)
    query = ParsedQuery(matrix=np.zeros((1, 2), np.float32), k=4, params=(), single=True, require_full=False,
                        offset=1, threshold=0.6)
    cut = windowed(query, result, ip)  # the first hit skipped, then those past 0.6 (above it for l2)
    assert cut.ids.tolist() == [[11, -1, -1]] and cut.distances.shape == (1, 3)
