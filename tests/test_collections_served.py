"""Collections through real Serve over HTTP: created, written, searched and dropped through the
client while two router replicas answer them (a write is visible to the next request through
either), creating one starts no process, a SIGKILLed router replica loses no acknowledged write of
a collection, a collections directory that cannot be made answers collection routes with a 501
that says what to set, and every process of `serve` SIGKILLed loses no collection nor write."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest

from shardserve.client import Client
from shardserve.errors import ApiError
from tests.conftest import SERVE_PORT as PORT

pytestmark = pytest.mark.slow


def _serve_pids(app: str) -> set[int]:
    """The processes of this app's replicas (Ray titles each replica's worker with its deployment)."""
    import psutil

    return {p.pid for p in psutil.process_iter(["cmdline"])
            if any(f"ServeReplica:{app}:" in part for part in p.info["cmdline"] or ())}


@pytest.fixture(scope="module")
def served(ray_cluster, small_index: Path, tmp_path_factory: pytest.TempPathFactory):
    from deployments.run import deploy, undeploy

    root = tmp_path_factory.mktemp("collections")
    url = deploy(str(small_index), port=PORT, app_name="colls", route_prefix="/colls", router_replicas=2,
                 shard_num_cpus=0.1, router_num_cpus=0.1, warm_workers=0, collections_dir=str(root))
    yield url
    undeploy("colls")


def test_collections_are_created_written_searched_and_dropped_through_either_replica(served: str) -> None:
    rng = np.random.default_rng(4)
    before = _serve_pids("colls")
    with Client(served) as client:
        docs = client.create_collection("docs", 8, "cosine", metadata={"lang": "string", "year": "int64"})
        small = client.create_collection("tiny-l2", 2)
        assert _serve_pids("colls") == before  # no process started
        assert [c["name"] for c in client.collections()] == ["docs", "tiny-l2"]
        with pytest.raises(ApiError) as taken:
            client.create_collection("docs", 8)
        assert taken.value.status == 409 and taken.value.field == "name"

        vectors = rng.normal(size=(300, 8)).astype(np.float32)
        metadata = [{"lang": ["en", "de", "fr"][i % 3], "year": 2000 + i % 20} for i in range(300)]
        for start in range(0, 300, 100):
            rows = slice(start, start + 100)
            docs.upsert(list(range(start, start + 100)), vectors[rows], metadata[rows])
        small.upsert([1, 2], np.array([[0, 0], [3, 4]], np.float32))
        normed = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        for row in (0, 57, 299):  # 2 router replicas: each answers some of these, every write seen
            for _ in range(4):
                hits = docs.search(vectors[row], k=3, include=["lang"])
                assert hits.ids[0] == row and hits.metadata[0] == {"lang": metadata[row]["lang"]}
        want = np.argsort(-(normed @ normed[5]))[:10]
        assert docs.search(vectors[5], k=10).ids.tolist() == want.tolist()  # exact while small
        german = [i for i in range(300) if metadata[i]["lang"] == "de"]
        assert docs.count() == 300 and docs.count(filter={"lang": "de"}) == len(german)
        assert sorted(docs.search(vectors[1], k=100, filter={"lang": "de"}).ids.tolist()) == german
        page, after = docs.scroll(limit=50, filter={"lang": "de"})
        assert [p.id for p in page] == german[:50] and after == german[49]
        (got,) = docs.get([7], vectors=True)
        assert got.metadata == metadata[7] and np.allclose(got.vector, normed[7], atol=1e-6)
        assert small.search(np.array([3, 4], np.float32), k=2).ids.tolist() == [2, 1]
        assert small.get([7]) == [] and docs.get([1])[0].id == 1  # an id of one never reaches the other

        docs.delete(filter={"lang": "fr"})
        left, _ = docs.scroll(limit=1000, include=[])
        assert docs.count() == 200 and [p.id for p in left] == [i for i in range(300) if i % 3 != 2]
        client.drop_collection("docs")
        with pytest.raises(ApiError) as gone:
            docs.count()
        assert gone.value.status == 404
        again = client.create_collection("docs", 3)
        assert again.count() == 0
        client.drop_collection("docs")
        client.drop_collection("tiny-l2")


def test_a_sigkilled_router_replica_loses_no_acknowledged_collection_write(served: str) -> None:
    """Writes to a collection acknowledged, then a router replica SIGKILLed: every one of them is
    found through the replicas that answer afterwards (the write log is the collection's)."""
    from loadtests.served import wait_for

    rng = np.random.default_rng(9)
    with Client(served) as client:
        notes = client.create_collection("notes", 4)
        vectors = rng.normal(size=(200, 4)).astype(np.float32)
        for i in range(0, 200, 20):
            notes.upsert(list(range(i, i + 20)), vectors[i:i + 20])
        routers = sorted(pid for pid in _serve_pids("colls") if _deployment(pid) == "Router")
        os.kill(routers[0], signal.SIGKILL)

        def replaced() -> bool:
            now = {pid for pid in _serve_pids("colls") if _deployment(pid) == "Router"}
            return routers[0] not in now and len(now) == len(routers)

        wait_for(replaced, "Serve replacing the killed router replica", timeout_s=120, interval_s=0.5)
        streak = [0]

        def answers() -> bool:
            # One answer is not enough: the proxy may still hold the dead replica beside a live one
            # (power of two choices), and a request sent there is cut (the CI failure of stop 74).
            try:
                streak[0] = streak[0] + 1 if notes.count() == 200 else 0
            except (ApiError, httpx.HTTPError):  # the killed replica's requests, until Serve routes around it
                streak[0] = 0
            return streak[0] >= 12

        wait_for(answers, "the collection answering 12 times running after the kill", timeout_s=120,
                 interval_s=0.2)
        for _ in range(6):
            assert notes.count() == 200
            assert [p.id for p in notes.get(list(range(200)), include=[])] == list(range(200))
        client.drop_collection("notes")


def _deployment(pid: int) -> str:
    from shardserve.runtime import procfs

    return procfs.cmdline(pid).split(b"\0", 1)[0].rsplit(b":", 1)[-1].decode(errors="replace")


def test_a_collections_directory_that_cannot_be_made_is_a_501_saying_what_to_set(
        ray_cluster, small_index: Path, tmp_path: Path) -> None:
    from deployments.run import deploy, undeploy

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    url = deploy(str(small_index), port=PORT, app_name="colls-ro", route_prefix="/colls-ro",
                 shard_num_cpus=0.1, router_num_cpus=0.1, warm_workers=0,
                 collections_dir=str(blocked / "sub"))
    try:
        with Client(url) as client:
            with pytest.raises(ApiError) as refused:
                client.create_collection("docs", 4)
            assert refused.value.status == 501 and "collections_dir" in refused.value.message
            assert client.search(np.zeros(784, np.float32), k=3).ids.size == 3  # the index answers as ever
    finally:
        undeploy("colls-ro")


@pytest.mark.haproxy
def test_collections_survive_a_sigkill_of_every_process_of_the_server(tmp_path: Path) -> None:
    """`shardserve serve` with collections written to from a thread that records each 200, every
    process of the server SIGKILLed mid-writes, then started again on the same directory: every
    collection created is there, every acknowledged upsert of one is found, a dropped one stays
    gone, and its name can be created again."""
    import threading

    from index_build.job import build_index
    from loadtests.served import Server
    from shardserve.runtime.ports import free_port

    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=2000, backend="local")
    port = free_port()
    server = Server(index, port, flags=("--num-cpus", "2"))
    acknowledged: list[int] = []
    grown: dict[int, np.ndarray] = {}
    stop = threading.Event()
    try:
        server.wait_said("Ctrl-C stops it.", 0)
        with Client(server.url) as client:
            kept = client.create_collection("kept", 4, metadata={"n": "int64"})
            client.create_collection("gone", 2)
            client.drop_collection("gone")

            def write() -> None:
                rng = np.random.default_rng(1)
                with Client(server.url, timeout_s=10) as writer:
                    target, n = writer.collection("kept"), 0
                    while not stop.is_set():
                        try:
                            target.upsert([n], rng.normal(size=(1, 4)).astype(np.float32), [{"n": n}])
                        except Exception:  # the server going: not acknowledged
                            continue
                        acknowledged.append(n)
                        n += 1

            grows = client.create_collection("grows", 8, index="IVF16,Flat", shards=2, grow_at=1000)

            def write_batches() -> None:  # 50 points a request into a collection that grows meanwhile
                rng = np.random.default_rng(2)
                with Client(server.url, timeout_s=10) as writer:
                    target, n = writer.collection("grows"), 0
                    while not stop.is_set():
                        vectors = rng.normal(size=(50, 8)).astype(np.float32)
                        try:
                            target.upsert(list(range(n, n + 50)), vectors)
                        except Exception:  # the server going: not acknowledged
                            continue
                        grown.update(zip(range(n, n + 50), vectors, strict=True))
                        n += 50

            writers = [threading.Thread(target=write), threading.Thread(target=write_batches)]
            for writer in writers:
                writer.start()
            # the server's folder builds it (Ray Data, the recall gate) while writes go on; both
            # router replicas move to the new version by themselves
            server.wait_for(lambda: grows.index()["stage"] == "built", "the collection grown", 300)
            built = len(grown)
            server.wait_for(lambda: len(acknowledged) >= 50 and len(grown) >= built + 500,
                            "writes acknowledged after the growth", 120)
            assert server.kill_all() > 0
            stop.set()
            for writer in writers:
                writer.join(timeout=60)
    finally:
        stop.set()
        server.stop()
    again = Server(index, port, flags=("--num-cpus", "2"))
    try:
        again.wait_said("Ctrl-C stops it.", 0)
        with Client(again.url) as client:
            assert [c["name"] for c in client.collections()] == ["kept", "grows"]
            kept = client.collection("kept")
            held = {p.id for start in range(0, len(acknowledged), 1000)
                    for p in kept.get(acknowledged[start:start + 1000], include=[])}
            assert set(acknowledged) <= held and kept.count() >= len(acknowledged)
            assert client.create_collection("gone", 2).count() == 0
            grows = client.collection("grows")
            described = grows.index()
            assert described["stage"] == "built" and described["built_as"] == "IVF16,Flat"
            ids = sorted(grown)
            found = {p.id: p.vector for start in range(0, len(ids), 1000)
                     for p in grows.get(ids[start:start + 1000], include=[], vectors=True)}
            assert set(found) == set(ids) and all(np.array_equal(found[i], grown[i]) for i in ids)
            matrix = np.stack([grown[i] for i in ids])
            hits = 0
            for query in matrix[:50]:  # recall@10 against brute force over the acknowledged points
                truth = np.asarray(ids)[np.argsort(((matrix - query) ** 2).sum(1))[:10]]
                hits += len(set(grows.search(query, k=10).ids) & set(truth.tolist()))
            assert hits / 500 >= 0.99
    finally:
        again.stop()


def _apart_replicas(server) -> list[bytes]:
    from shardserve.runtime import procfs

    titles = [procfs.cmdline(pid).split(b"\0", 1)[0] for pid in server.pids()]
    return [title for title in titles if b"ServeReplica:collection-" in title]


@pytest.mark.haproxy
def test_a_large_collection_is_served_apart_by_shard_deployments_of_its_own(tmp_path: Path) -> None:
    """`shardserve serve`: a collection built past its `apart_at` is deployed as its own router and
    shards (processes that were not there), every request to it forwarded there and answered from
    the same directory and log (nothing written before is lost, writes after are read back at once),
    a fold of it swapped into its shards, and once it is dropped, its processes go."""
    from index_build.job import build_index
    from loadtests.served import Server
    from shardserve.runtime.ports import free_port

    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=2000, backend="local")
    server = Server(index, free_port(), log=tmp_path / "serve.log",
                    flags=("--num-cpus", "2", "--arg", "min_apart_at=1000"))
    rng = np.random.default_rng(4)
    points: dict[int, np.ndarray] = {}

    def write(client: Client, ids: range) -> None:
        for start in range(ids.start, ids.stop, 500):
            part = list(range(start, min(start + 500, ids.stop)))
            vectors = rng.normal(size=(len(part), 8)).astype(np.float32)
            client.upsert(part, vectors)
            points.update(zip(part, vectors, strict=True))

    def check(client: Client) -> None:
        ids = sorted(points)
        found = {p.id: p.vector for start in range(0, len(ids), 1000)
                 for p in client.get(ids[start:start + 1000], include=[], vectors=True)}
        assert set(found) == set(ids) and all(np.array_equal(found[i], points[i]) for i in ids)
        assert client.count() == len(ids)
        matrix = np.stack([points[i] for i in ids])
        hits = 0
        for query in matrix[:30]:
            truth = np.asarray(ids)[np.argsort(((matrix - query) ** 2).sum(1))[:10]]
            hits += len(set(client.search(query, k=10).ids) & set(truth.tolist()))
        assert hits / 300 >= 0.99

    try:
        server.wait_said("Ctrl-C stops it.", 0)
        with Client(server.url, timeout_s=60) as client:
            assert _apart_replicas(server) == []
            big = client.create_collection("big", 8, index="IVF16,Flat", shards=2, grow_at=1000,
                                           apart_at=1000)
            write(big, range(0, 1500))
            described = server.wait_for(lambda: (d := big.index())["served_by"] and d, "served apart", 300)
            assert described["stage"] == "built" and described["served_by"].startswith("collection-")
            assert len(_apart_replicas(server)) >= 3  # its router and its 2 shards
            check(big)  # what the router replicas held is all there
            write(big, range(1500, 1700))
            big.delete([3, 1600])
            points.pop(3), points.pop(1600)
            check(big)  # forwarded writes, read back at once
            version = described["version"]
            write(big, range(2000, 6200))  # past the fold threshold: compacted, swapped into its shards
            server.wait_for(lambda: big.index()["version"] != version, "the fold swapped in", 300)
            check(big)
            client.drop_collection("big")
            with pytest.raises(ApiError):
                big.count()
            server.wait_for(lambda: _apart_replicas(server) == [], "its processes gone", 300, 0.5)
    finally:
        server.stop()
