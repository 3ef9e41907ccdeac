"""Online writes through real Serve over HTTP: a 200 is durable and visible to the next search
through any replica, an id is answered at most once with its latest vector and metadata, a deleted
id never comes back (under a filter, after a SIGKILL of any process, after a restart), and a refused
write leaves nothing behind."""

from __future__ import annotations

import io
import os
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from index_build.job import build_index
from loadtests.compact_under_load import run as compact_run
from loadtests.crash_writes import KINDS
from loadtests.crash_writes import run as crash_run
from loadtests.served import Server
from shardserve.client import AsyncClient, Client
from shardserve.data.datasets import load_dataset
from shardserve.errors import ApiError
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location
from shardserve.runtime.ports import free_port
from shardserve.writes.delta import MAX_DELTA_ROWS
from tests.conftest import SERVE_PORT as PORT
from tests.shared import DIM, write_parquet

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def writable(ray_cluster, tmp_path_factory: pytest.TempPathFactory):
    """A 2-shard IVF index with a `caption` column, 2 replicas per shard, served under /writes."""
    from deployments.run import deploy, undeploy

    root = tmp_path_factory.mktemp("writes")
    source = write_parquet(root / "emb")
    build_index(str(source), 2, "IVF32,Flat", str(root / "idx"), backend="local", vector_column="emb",
                id_column="doc_id", metadata_columns=["caption"])
    url = deploy(str(root / "idx"), port=PORT, app_name="writes", route_prefix="/writes",
                 replicas_per_shard=2, shard_num_cpus=0.1, router_num_cpus=0.1, warm_workers=0)
    data = load_dataset(str(source), vector_column="emb", id_column="doc_id")
    yield url, data
    undeploy("writes")


def _vector(rng: np.random.Generator) -> np.ndarray:
    return rng.normal(0, 3, DIM).astype(np.float32)


def test_a_write_is_seen_by_the_next_search_on_any_replica(writable) -> None:
    url, data = writable
    rng = np.random.default_rng(3)
    with Client(url) as writer, Client(url) as reader:
        summary = reader.index()
        assert summary["max_write_points"] == 1000 and summary["max_write_backlog"] == MAX_DELTA_ROWS
        assert (summary["max_metadata_bytes"], summary["max_string_bytes"]) == (16 * 1024, 8 * 1024)
        huge = httpx.post(f"{url}/v1/upsert", timeout=30, content=orjson.dumps(  # 8 MB: refused, not held
            {"ids": [1], "vectors": [[0.0] * DIM], "metadata": [{"caption": "x" * 8_000_000}]}))
        assert huge.status_code == 422 and huge.json()["field"] == "metadata", huge.text
        assert summary["metadata_kinds"] == {"caption": "string"}
        new, vector = 7 << 50, _vector(rng)
        first = writer.upsert([new], vector[None], metadata=[{"caption": "fresh"}])
        assert first["upserted"] == 1 and first["position"] >= 1
        for _ in range(12):  # 2 replicas per shard: each answers some of these
            hits = reader.search(vector, k=5, include=["caption"])
            assert hits.ids[0] == new and hits.metadata[0] == {"caption": "fresh"}
        hits = reader.search(vector, k=5, filter={"caption": "fresh"})
        assert hits.ids.tolist() == [new] and hits.extra["matched"] == 1

        # an overwrite of a base row: answered once, with its new vector and metadata
        base_id = int(reader.search(data.queries[0], k=1).ids[0])
        moved = _vector(rng) + 40.0
        second = writer.upsert([base_id], moved[None], metadata=[{"caption": "moved"}])
        assert second["position"] > first["position"]
        hits = reader.search(moved, k=5, include=["caption"])
        assert hits.ids[0] == base_id and hits.metadata[0] == {"caption": "moved"}
        assert hits.distances[0] == pytest.approx(0.0, abs=1e-3)
        everywhere = reader.search(data.queries[0], k=100)
        assert len(set(everywhere.ids.tolist())) == len(everywhere.ids)  # never twice
        assert reader.search(data.queries[0], k=100, filter={"caption": "moved"}).ids.tolist() \
            == [base_id]

        # deletes: gone at once, under a filter too
        gone = writer.delete([new, base_id])
        assert gone == {"position": second["position"] + 1, "deleted": 2}
        for _ in range(6):
            assert new not in reader.search(vector, k=10).ids
            assert base_id not in reader.search(moved, k=10).ids
        either = {"caption": {"$in": ["fresh", "moved"]}}
        assert reader.search(vector, k=5, filter=either).ids.size == 0


def test_a_delete_by_filter_deletes_what_matches_now_and_nothing_else(writable) -> None:
    url, data = writable
    rng = np.random.default_rng(6)
    doomed = {"caption": "doomed-by-filter"}
    with Client(url) as writer, Client(url) as reader:
        base_id = int(reader.search(data.queries[1], k=1).ids[0])  # a base row, renamed by an upsert
        vectors = np.stack([_vector(rng) + 120.0 for _ in range(4)])
        ids = [20 << 50, 21 << 50, 22 << 50, base_id]
        written = writer.upsert(ids, vectors, metadata=[doomed, doomed, {"caption": "kept"}, doomed])
        assert reader.search(vectors[0], k=10, filter=doomed).extra["matched"] == 3
        gone = writer.delete(filter=doomed)
        assert gone == {"position": written["position"] + 1, "deleted": 3}
        for _ in range(6):  # 2 replicas per shard: each saw it
            assert reader.search(vectors[0], k=10, filter=doomed).ids.size == 0
            found = reader.search(vectors[2], k=10).ids.tolist()
            assert ids[2] in found and not {ids[0], ids[1], base_id} & set(found)
        assert base_id not in reader.search(data.queries[1], k=10).ids
        again = writer.delete(filter=doomed)  # nothing matches any more: nothing written
        assert again == {"position": None, "deleted": 0}
        for body, field in (({"ids": [1], "filter": doomed}, "filter"), ({"filter": {"nope": 1}}, "filter")):
            answer = httpx.post(f"{url}/v1/delete", content=orjson.dumps(body), timeout=30)
            assert answer.status_code == 422 and answer.json()["field"] == field, answer.text
        assert writer.delete([ids[2]])["position"] == gone["position"] + 1  # the refused left nothing


def test_a_refused_write_leaves_nothing_behind(writable) -> None:
    """Each bad write is a 422 naming its field, and the next good one takes the very next log
    position: nothing of the refused ones reached the log."""
    url, _ = writable
    rng = np.random.default_rng(4)
    with Client(url) as client:
        before = client.upsert([9 << 50], _vector(rng)[None])["position"]
        bad = [
            ({"ids": [1], "vectors": [[0.0] * (DIM + 1)]}, "vectors"),
            ({"ids": [1, 1], "vectors": [[0.0] * DIM] * 2}, "ids"),
            ({"ids": [-1], "vectors": [[0.0] * DIM]}, "ids"),
            ({"ids": [2**63], "vectors": [[0.0] * DIM]}, "ids"),
            ({"ids": [1], "vectors": [[0.0] * DIM], "metadata": [{"nope": 1}]}, "metadata"),
            ({"ids": [1], "vectors": [[0.0] * DIM], "metadata": [{"caption": 3}]}, "metadata"),
            ({"ids": list(range(1001)), "vectors": [[0.0] * DIM] * 1001}, "ids"),
            ({"ids": [1], "vectors": [[0.0] * DIM], "wait": "maybe"}, "wait"),
        ]
        for body, field in bad:
            answer = httpx.post(f"{url}/v1/upsert", content=orjson.dumps(body), timeout=30)
            assert answer.status_code == 422 and answer.json()["field"] == field, (body, answer.text)
        nan = httpx.post(f"{url}/v1/upsert", content=b'{"ids": [1], "vectors": [[NaN' + b', 0' * (DIM - 1)
                         + b']]}', timeout=30)
        assert nan.status_code == 422 and nan.json()["field"] == "vectors"
        ids, vectors = io.BytesIO(), io.BytesIO()  # .npy: the ids array twice over, then vectors
        np.save(ids, np.array([3, 3], np.int64))
        np.save(vectors, np.zeros((2, DIM), np.float32))
        twice = httpx.post(f"{url}/v1/upsert", content=ids.getvalue() + vectors.getvalue(), timeout=30,
                           headers={"content-type": "application/x-npy"})
        assert twice.status_code == 422 and twice.json()["field"] == "ids", twice.text
        with pytest.raises(ApiError) as refused:
            client.delete([])
        assert refused.value.status == 422 and refused.value.field == "ids"
        after = client.upsert([10 << 50], _vector(rng)[None])["position"]
        assert after == before + 1


def test_the_async_client_writes_too(writable) -> None:
    import asyncio

    url, _ = writable
    vector = _vector(np.random.default_rng(5)) + 80.0

    async def round_trip() -> tuple[dict, list[int], dict, list[int]]:
        async with AsyncClient(url) as client:
            done = await client.upsert([11 << 50], vector[None])
            found = (await client.search(vector, k=3)).ids.tolist()
            gone = await client.delete([11 << 50])
            return done, found, gone, (await client.search(vector, k=3)).ids.tolist()

    done, found, gone, after = asyncio.run(round_trip())
    assert done["upserted"] == 1 and found[0] == 11 << 50
    assert gone["deleted"] == 1 and (11 << 50) not in after


def test_a_client_given_several_edges_moves_past_one_it_cannot_reach(writable) -> None:
    """A cluster's list of edges: the first one down (nothing listens on its port), the client
    answers through the next, writes included, and stays there; all down raises the connect error."""
    import asyncio

    url, _ = writable
    down = f"http://127.0.0.1:{free_port()}"
    vector = _vector(np.random.default_rng(9)) + 90.0
    with Client([down, url]) as client:
        assert client.upsert([12 << 50], vector[None])["upserted"] == 1
        assert client.search(vector, k=3).ids[0] == 12 << 50
        assert client._edges.current == 1  # stays on the edge that answered
        assert client.delete([12 << 50])["deleted"] == 1

    async def through_the_second() -> list[int]:
        async with AsyncClient([down, url]) as client:
            return (await client.search(vector, k=3)).ids.tolist()

    assert (12 << 50) not in asyncio.run(through_the_second())
    with Client([down]) as client, pytest.raises(httpx.ConnectError):
        client.health()
    with pytest.raises(ValueError, match="at least one"):
        Client([])


def test_overwrites_moving_ids_between_shards_never_answer_an_id_twice(writable) -> None:
    """1,500 base points overwritten with their own vectors, one request each: a point's new home is
    a hash of its id, so about half move to the other shard, and each copy ties the other. Six
    clients search those vectors meanwhile. Before one search saw one log position, a shard that had
    caught up answered the new copy and another, not yet, the old one: about one answer in a
    hundred held an id twice."""
    import threading

    url, data = writable
    rows = np.random.default_rng(21).choice(len(data.base), 1500, replace=False)
    ids, vectors = data.ids[rows], data.base[rows]
    done, twice, answers, failures = threading.Event(), [], [0], []

    def search(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(url) as reader:
            while not done.is_set():
                try:
                    found = reader.search(vectors[rng.integers(0, len(rows))], k=10).ids.tolist()
                except Exception as exc:  # any failure fails the test, after the writer stops
                    failures.append(repr(exc))
                    return
                answers[0] += 1
                if len(found) != len(set(found)):
                    twice.append(found)

    readers = [threading.Thread(target=search, args=(seed,)) for seed in range(6)]
    for reader in readers:
        reader.start()
    try:
        with Client(url) as writer:
            for row, id_ in enumerate(ids.tolist()):
                writer.upsert([id_], vectors[row][None], metadata=[{"caption": f"caption {rows[row]}"}])
    finally:
        done.set()
        for reader in readers:
            reader.join()
    assert not failures, failures[:3]
    assert answers[0] > 100 and twice == [], (len(twice), answers[0], twice[:3])


@pytest.mark.haproxy
def test_acknowledged_writes_survive_sigkills_of_a_shard_the_router_the_server_and_its_compaction(
        tmp_path: Path) -> None:
    """The default `shardserve serve` under single upserts, deletes (by id and by filter) and
    searches, compacting by itself every 40 operations; one SIGKILL of a shard replica, of the
    router replica, of every process of the server, and of every process while an automatic
    compaction runs (each time started again on the same index directory): every acknowledged
    upsert is found by its own vector, no acknowledged delete comes back, and each 200 was seen by
    a search on another connection right after it."""
    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="local")
    record = crash_run(index, kills=1, writes_between=20, work=tmp_path / "work")
    assert [event["kind"] for event in record["kills"]] == list(KINDS)
    assert "compaction" in KINDS and record["compactions_started"] >= 1
    assert all(event["acked_after"] >= event["acked_before"] + 20 for event in record["kills"])
    assert record["upserts_checked"] > 0 and record["deletes_checked"] > 0
    assert record["upserts_lost"] == [] and record["deletes_returned"] == []
    seen = record["read_your_writes"]
    assert seen["upserts_found"] > 0 and seen["upserts_missed"] == 0, seen
    assert seen["deletes_absent"] > 0 and seen["deletes_found"] == 0, seen
    by_filter = record["filter_deletes"]  # the deleted tagged ids are among deletes_checked above
    assert by_filter["acked"] > 0 and by_filter["outside_the_tagged"] == 0, by_filter
    assert by_filter["deleted_exactly_the_tagged"] == by_filter["all_tagged_acknowledged"] > 0, by_filter


@pytest.mark.haproxy
@pytest.mark.release  # a minute of load; the compaction a SIGKILL interrupts, and the server's own
# compaction and swap under writes, run on every CI run (above and below)
def test_compaction_and_its_swap_under_searches_and_upserts_answer_everything(tmp_path: Path) -> None:
    """`shardserve compact` then `shardserve swap` while the default server takes an open loop of
    searches and single upserts: every request answered 200, every acknowledged upsert found after,
    and the server now serves the compacted version, at its log position."""
    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="local")
    record = compact_run(index, tmp_path / "work", searches_per_s=40, upserts_per_s=10, seconds=60,
                         compact_after_s=8, upserts_stop_s=30, warm_s=5, settle_s=0)
    assert [step["command"] for step in record["steps"]] == ["shardserve compact", "shardserve swap"] * 2
    assert record["searches"]["success_ratio"] == 1.0, record["searches"]
    upserts = record["upserts"]
    assert set(upserts["statuses"]) == {"200"} and upserts["lost"] == [], upserts
    assert record["compacted_log_position"] > 0
    served = record["served_after"]  # the last compaction folded every write: nothing left in a delta
    assert (served["index_version"], served["log_position"]) == (record["compacted_version"],
                                                                 record["compacted_log_position"])
    assert set(record["memory"]["after_last_swap"]) == {"router", "shards"}, record["memory"]


def _newer(client: Client, first: str) -> dict:
    """What the server says of its index once it serves another version than `first` (else {})."""
    served = client.index()
    return served if served["index_version"] != first else {}


def _small_index_and_new_points(tmp_path: Path, seed: int, first_id: int, count: int,
                                factory: str = "IVF64,Flat"):
    """A 5,000-row 2-shard IVF index of Fashion-MNIST, its version, the data, and `count` new
    points (ids from `first_id`, vectors near base rows) to upsert into it."""
    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, factory, str(index), limit=5000, backend="local")
    first = read_manifest(Location.parse(str(index))).index_version
    data = load_dataset("fashion-mnist", limit=5000, num_queries=10)
    rng = np.random.default_rng(seed)
    ids = list(range(first_id, first_id + count))
    vectors = (data.base[rng.integers(0, 5000, count)] + rng.normal(0, 8, (count, data.base.shape[1]))
               ).astype(np.float32)
    return index, first, data, ids, vectors


@pytest.mark.haproxy
# IVF-Flat's own compaction by the server runs on every CI run with the Redis log (below), this
# one's with the refined fast-scan IVF-PQ, whose compaction once could not rewrite it
@pytest.mark.parametrize("factory", [pytest.param("IVF64,Flat", marks=pytest.mark.release),
                                     "IVF64,PQ16x4fs,RFlat"])
def test_the_default_server_compacts_and_swaps_by_itself_once_enough_writes_wait(tmp_path: Path,
                                                                               factory: str) -> None:
    """`shardserve serve --compact-at N` with nothing else: once N operations wait past the served
    version, it compacts and swaps on its own (its default logical CPUs leave room for the second
    version), the new version is at the last write's position, every upsert is found and no deleted
    id is answered. A refined IVF-PQ index too (`--index auto` picks such kinds for large builds:
    compaction answered "remove_ids not implemented for this type of index" and failed every time)."""
    index, first, data, ids, vectors = _small_index_and_new_points(tmp_path, 5, 1 << 40, 400, factory)
    deleted = list(range(50))  # base rows: their ids are their row numbers
    server = Server(index, free_port(), tmp_path / "serve.log", ("--compact-at", "450"))
    try:
        server.wait_healthy()
        with Client(server.url, timeout_s=60) as client:
            for start in range(0, 400, 100):
                client.upsert(ids[start:start + 100], vectors[start:start + 100])
            last = client.delete(deleted)["position"]  # 400 upserts + 50 deletes: the threshold
            # the compactor polls every 5 s; compaction and swap take a while
            served = server.wait_for(lambda: _newer(client, first), "a new version served", interval_s=1)
            assert served["log_position"] == last and served["num_vectors"] == 5000 - 50 + 400
            if factory == "IVF64,Flat":  # exact vectors: each is its own nearest
                for id_, vector in zip(ids[::20], vectors[::20], strict=True):
                    assert int(client.search(vector, k=1).ids[0]) == id_
            for id_ in deleted:
                assert id_ not in client.search(data.base[id_], k=10).ids.tolist()
            held = client.search(vectors[0], k=100, filter={"$id": {"$in": ids[:100]}})  # by id, any kind
            assert sorted(held.ids.tolist()) == ids[:100]
            gone = client.search(data.base[0], k=50, filter={"$id": {"$in": deleted}})
            assert gone.ids.size == 0
        # The routers serve the new version before the compactor's swap call returns to it and it
        # says so: wait for its line while the server runs (stopping it first could cut the line).
        log = tmp_path / "serve.log"
        server.wait_for(lambda: "compacted and swapped to" in log.read_text(), "the compactor's line",
                        interval_s=1)
    finally:
        server.stop()


@pytest.mark.haproxy
@pytest.mark.redis
def test_with_a_redis_write_log_writes_compaction_and_a_sigkill_of_the_server_keep_every_write(
        tmp_path: Path) -> None:
    """`shardserve serve` with SHARDSERVE_WRITE_LOG naming a Redis (a cluster's log, run here on one
    machine): no SQLite file is written; upserts and deletes are answered and seen at once; the
    automatic compaction folds them from the stream; after a SIGKILL of every
    process of the server and a start again, every upsert is found and no deleted id is answered."""
    from loadtests.local_cluster import RedisStore
    from shardserve.writes.locate import log_address
    from shardserve.writes.redis_log import RedisWriteLog

    index, first, data, ids, vectors = _small_index_and_new_points(tmp_path, 7, 1 << 41, 300)
    deleted = list(range(100, 150))
    with RedisStore(port=free_port()) as store:
        env = store.write_log_env()
        port = free_port()
        server = Server(index, port, tmp_path / "serve.log", ("--compact-at", "300"), env=env)
        try:
            server.wait_healthy()
            with Client(server.url, timeout_s=60) as client:
                for start in range(0, 300, 100):
                    client.upsert(ids[start:start + 100], vectors[start:start + 100])
                    assert int(client.search(vectors[start], k=1).ids[0]) == ids[start]  # at once
                last = client.delete(deleted)["position"]
                assert 100 not in client.search(data.base[100], k=10).ids.tolist()
                # the compactor polls every 5 s
                served = server.wait_for(lambda: _newer(client, first), "a new version served", interval_s=1)
                assert served["log_position"] == last and served["num_vectors"] == 5000 - 50 + 300, served
            server.kill_all()
            server = Server(index, port, tmp_path / "serve.log", ("--compact-at", "300"), env=env)
            server.wait_healthy()
            with Client(server.url, timeout_s=60) as client:
                found = client.search_batch(vectors, k=1, require_full=True)
                assert [int(hit.ids[0]) for hit in found] == ids
                gone = client.search_batch(data.base[deleted], k=10, require_full=True)
                assert not set(deleted) & {int(i) for hit in gone for i in hit.ids}
        finally:
            server.stop()
        assert not (index / "writes").exists()  # the log was Redis's, not a file beside the index
        for name, value in env.items():
            os.environ[name] = value
        try:
            log = RedisWriteLog(log_address(str(index)), readonly=True)  # type: ignore[arg-type]
            # all in Redis: the version before the compaction (kept for a rollback) still needs them
            assert log.last_position() == last and log.first_position() == 1
            log.close()
        finally:
            for name in env:
                del os.environ[name]


def _everything(client: Client, limit: int, **options) -> list[int]:
    """Every id a scroll walks through, page by page (each page ascending past the last)."""
    ids: list[int] = []
    after = None
    while True:
        points, after = client.scroll(after=after, limit=limit, include=[], **options)
        assert points or after is None  # an empty page is the last
        assert [p.id for p in points] == sorted(p.id for p in points)
        assert not ids or not points or points[0].id > ids[-1]
        ids += [p.id for p in points]
        if after is None:
            return ids


def test_get_count_and_scroll_answer_exactly_what_is_held(writable) -> None:
    """The point API against what the index holds after each write: a count equals the ids a
    scroll walks through (no id twice, whatever the page size), a get answers the latest metadata
    and vector of each id held (a base row, a new point, an overwrite that moved shards) and leaves
    out deleted and unknown ids, filters count and scroll the same points a search's do; a search's
    offset and score threshold cut its hits."""
    url, data = writable
    rng = np.random.default_rng(11)
    with Client(url) as client:
        before = _everything(client, 1000)
        assert len(before) == len(set(before)) == client.count() and before == sorted(before)
        assert _everything(client, 7)[:50] == before[:50]  # pages of 7: the same order

        new = [(31 << 50) + i for i in range(30)]  # ids no other test here writes
        vectors = np.stack([_vector(rng) for _ in new])
        client.upsert(new, vectors, metadata=[{"caption": "point api"} for _ in new])
        base_id = before[len(before) // 2]
        moved = _vector(rng) + 60.0  # an overwrite far from its row: it may route to the other shard
        client.upsert([base_id], moved[None], metadata=[{"caption": "point api moved"}])
        client.delete(new[:5])
        held = sorted((set(before) - set(new[:5])) | set(new[5:]))
        assert _everything(client, 100) == held and client.count() == len(held)

        got = client.get([new[7], new[2], base_id, 12345678, new[9]], vectors=True)
        assert [p.id for p in got] == [new[7], base_id, new[9]]  # asked order; deleted and unknown left out
        assert got[0].metadata == {"caption": "point api"} and np.array_equal(got[0].vector, vectors[7])
        assert got[1].metadata == {"caption": "point api moved"} and np.allclose(got[1].vector, moved)
        other = before[0]
        (base,) = client.get([other], vectors=True)
        row = int(np.flatnonzero(data.ids == other)[0])
        assert np.allclose(base.vector, data.base[row]) and base.metadata == {"caption": f"caption {row}"}
        assert client.get([new[8]], include=[])[0].metadata == {}

        mine = {"caption": "point api"}
        assert client.count(filter=mine) == 25
        assert _everything(client, 10, filter=mine) == new[5:]
        assert client.count(filter={"caption": "point api moved"}) == 1

        hits = client.search(vectors[10], k=10)
        skipped = client.search(vectors[10], k=5, offset=5)
        assert skipped.ids.tolist() == hits.ids[5:].tolist()
        cut = float(hits.distances[3])
        near = client.search(vectors[10], k=10, score_threshold=cut)
        assert near.ids.tolist() == hits.ids[hits.distances <= cut].tolist()

        for route, body, field in [
                ("/v1/points", {"ids": []}, "ids"), ("/v1/points", {"ids": list(range(1001))}, "ids"),
                ("/v1/points", {"ids": [-1]}, "ids"),
                ("/v1/points", {"ids": [1], "include": ["nope"]}, "include"),
                ("/v1/points", {"ids": [1], "vectors": 1}, "vectors"), ("/v1/scroll", {"limit": 0}, "limit"),
                ("/v1/scroll", {"after": "a"}, "after"), ("/v1/count", {"filter": {"nope": 1}}, "filter"),
                ("/v1/search", {"vector": vectors[0].tolist(), "k": 90, "offset": 20}, "offset")]:
            refused = httpx.post(f"{url}{route}", json=body, timeout=30)
            assert refused.status_code == 422 and refused.json()["field"] == field, refused.text
        client.delete(new[5:])
