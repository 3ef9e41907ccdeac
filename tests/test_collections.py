"""Collections below Ray: the catalogue (a collection exists whole or not at all across SIGKILLs of
the process creating or dropping it; names and ids), and one router replica's collections front
(shardserve's own routes, answered from real FAISS indexes and SQLite write logs), checked step by
step against a plain numpy reference by a Hypothesis state machine over collections of different
dimensions and metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from deployments.collections import CollectionsFront
from deployments.config import AppArgs
from index_build.empty import create_empty
from index_build.grow import fold
from shardserve.collection.catalogue import CATALOGUE, Catalogue, NameTaken
from shardserve.collection.spec import CollectionSpec
from shardserve.query.api import ApiError, Limits
from shardserve.transport.http_front import Request


def _spec(name: str = "docs", dim: int = 4, **fields) -> CollectionSpec:
    return CollectionSpec(name=name, dim=dim, **fields)


def test_names_ids_and_a_failed_creation(tmp_path: Path) -> None:
    catalogue = Catalogue(tmp_path)
    first = catalogue.create(_spec(metadata={"label": "int64"}), create_empty)
    assert (first.path / "manifest.json").exists() and catalogue.get("docs") == first
    with pytest.raises(NameTaken):
        catalogue.create(_spec(dim=8), create_empty)

    def broken(directory: Path, spec: CollectionSpec) -> None:
        create_empty(directory, spec)
        raise OSError("disk full")

    with pytest.raises(OSError):
        catalogue.create(_spec("other"), broken)
    assert catalogue.get("other") is None and sorted(p.name for p in tmp_path.glob("c[0-9]*")) == ["c1"]
    assert catalogue.drop("docs") == first and not first.path.exists() and catalogue.drop("docs") is None
    again = catalogue.create(_spec(dim=8), create_empty)  # the name is free; the id is new
    assert again.id not in (first.id, first.id + 1) and again.spec.dim == 8
    assert [entry.name for entry in catalogue.live()] == ["docs"]
    reader = Catalogue(tmp_path, readonly=True)
    assert reader.get("docs") == again
    catalogue.close()
    reader.close()


@pytest.mark.parametrize("fields, says", [
    ({"name": "../etc"}, "name"), ({"name": "ab"}, "name"), ({"name": "a" * 64}, "name"),
    ({"dim": 0}, "dim"), ({"dim": 10_000}, "dim"), ({"metric": "hamming"}, "metric"),
    ({"metadata": {"bad col": "string"}}, "metadata"), ({"metadata": {"x": "int128"}}, "metadata"),
    ({"metadata": {"id": "int64"}}, "reserved"), ({"index": "IVF4096,PQ8"}, "index"),
    ({"index": "Flat; DROP TABLE"}, "index"), ({"shards": 65}, "shards"),
])
def test_a_bad_spec_is_refused_before_anything_sees_it(fields: dict, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        CollectionSpec(**{"name": "docs", "dim": 4, **fields})
    assert says in str(refused.value)


_CHILD = """
import os, sys, time
from pathlib import Path
from index_build.empty import create_empty
from shardserve.collection.catalogue import Catalogue
from shardserve.collection.spec import CollectionSpec

def made_then_wait(directory, spec):
    create_empty(directory, spec)
    print("made", flush=True)
    time.sleep(600)

Catalogue(sys.argv[1]).create(CollectionSpec(name="docs", dim=4), made_then_wait)
"""


def test_a_creation_killed_midway_leaves_nothing_once_recovered_and_one_under_way_is_left_alone(
        tmp_path: Path) -> None:
    """SIGKILL of the process creating a collection, after its directory is made and before it is
    live: while that process lives, another's recovery leaves its creation alone (it holds the
    name's lock); once it is killed, the next recovery removes the directory and the row, and the
    name is free."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_CHILD), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "made"
        other = Catalogue(tmp_path)  # opens and recovers beside the live creator: leaves it alone
        assert other.recover() == [] and other.get("docs") is None
        assert (tmp_path / "c1" / "manifest.json").exists() and _states(tmp_path) == [("docs", "creating")]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert other.recover() == [1]
    assert not (tmp_path / "c1").exists() and _states(tmp_path) == []
    assert other.create(_spec(), create_empty).id == 2


def _states(root: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(root / CATALOGUE) as db:
        return db.execute("SELECT name, state FROM collections ORDER BY id").fetchall()


_DROPPER = """
import sys, time
from shardserve.collection import catalogue

def stalled(path, ignore_errors=False):  # the drop's commit is done; its deletion never comes
    print("committed", flush=True)
    time.sleep(600)

catalogue.shutil.rmtree = stalled
catalogue.Catalogue(sys.argv[1]).drop("docs")
"""


def test_a_drop_killed_after_its_commit_is_finished_by_recovery(tmp_path: Path) -> None:
    """SIGKILL of the process dropping a collection, between the drop's commit and the deletion of
    its directory: it is gone for every reader at once, and the next recovery deletes it."""
    catalogue = Catalogue(tmp_path)
    entry = catalogue.create(_spec(), create_empty)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_DROPPER), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "committed"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert catalogue.get("docs") is None and entry.path.exists()  # gone for readers at once
    assert _states(tmp_path) == [("docs", "dropped")]
    assert Catalogue(tmp_path).recover() == [] and not entry.path.exists()  # opening recovered it
    assert _states(tmp_path) == []


def test_recovery_never_clears_a_live_collection_and_sweeps_unnamed_directories(tmp_path: Path) -> None:
    """A creation that finished between recovery's read of the rows and its lock is live: recovery
    leaves it (its conditional mark finds no `creating` row). A directory no row names (a creation
    killed, its row cleared before its directory) goes."""
    catalogue = Catalogue(tmp_path)
    entry = catalogue.create(_spec(), create_empty)
    assert catalogue._abandon(entry.id) is False and entry.path.exists() and catalogue.get("docs") == entry
    orphan = tmp_path / "c99"
    orphan.mkdir()
    assert catalogue.recover() == [] and not orphan.exists() and entry.path.exists()


# The collections front of one router replica, as the router calls it


def _front(root: Path) -> CollectionsFront:
    args = AppArgs(index="-", max_collections_held=2)
    limits = Limits(100, 64, 1 << 30, 1 << 24, 1000, 200_000)
    return CollectionsFront(root, args, limits)


# One router replica's collections front in a process of its own, behind the real front door on
# loopback: what a SIGKILL can stop mid-request. Started ahead (its imports take seconds), it waits
# for its directory on stdin, then prints the port it listens on; it ends when stdin closes (the
# test's process gone).
_REPLICA = textwrap.dedent("""
    import asyncio, os, sys, threading
    from pathlib import Path
    from deployments.collections import CollectionsFront
    from deployments.config import AppArgs
    from deployments.router import _error
    from shardserve.query.api import ApiError, Limits
    from shardserve.transport.http_front import FrontDoor

    root = sys.stdin.readline().strip()
    if not root:
        sys.exit(0)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()

    async def main():
        args = AppArgs(index="-", max_collections_held=2)
        front = CollectionsFront(Path(root), args, Limits(100, 64, 1 << 30, 1 << 24, 1000, 200_000))

        async def handler(request):
            try:
                return await front.respond(request, request.path)
            except ApiError as error:
                return _error(error)

        _, port = await FrontDoor(handler, 1 << 24, 30).listen("127.0.0.1", 0)
        print(port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


class ReplicaProcess:
    """A router replica's collections in a child process, asked over HTTP; `kill` SIGKILLs it."""

    _spare: subprocess.Popen | None = None  # the next one, started ahead

    @staticmethod
    def _spawn() -> subprocess.Popen:
        here = Path(__file__).resolve().parent.parent
        return subprocess.Popen([sys.executable, "-c", _REPLICA], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, cwd=here, env={**os.environ, "PYTHONPATH": str(here)})

    def __init__(self, root: Path):
        self.child = ReplicaProcess._spare or self._spawn()
        ReplicaProcess._spare = self._spawn()
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(f"{root}\n".encode())
        self.child.stdin.flush()
        self.url = f"http://127.0.0.1:{int(self.child.stdout.readline())}"
        self.client = httpx.Client(timeout=60.0)  # a kept connection: one call costs a millisecond

    def call(self, method: str, route: str, body: object = None) -> tuple[int, dict]:
        raw = b"" if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        reply = self.client.request(method, self.url + route, content=raw,
                                    headers={"content-type": "application/json"})
        return reply.status_code, reply.json()

    def kill(self) -> None:
        self.client.close()
        os.kill(self.child.pid, signal.SIGKILL)
        self.child.wait()
        assert self.child.returncode == -signal.SIGKILL

    def close(self) -> None:
        if self.child.poll() is None:
            self.kill()


def _call(front: CollectionsFront | ReplicaProcess, method: str, route: str, body: object = None
          ) -> tuple[int, dict]:
    if isinstance(front, ReplicaProcess):
        return front.call(method, route, body)
    raw = b"" if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    request = Request(method, route, raw, "", "application/json", {})

    async def answer():
        try:
            return await front.respond(request, route)
        except ApiError as error:
            return error

    reply = asyncio.run(answer())
    if isinstance(reply, ApiError):
        return reply.status, {"error": reply.message, "field": reply.field}
    return reply.status, orjson.loads(reply.body)


def _on(front: CollectionsFront | ReplicaProcess, name: str, operation: str, body: object
        ) -> tuple[int, dict]:
    return _call(front, "POST", f"/v1/collections/{name}/{operation}", body)


def test_collections_answer_their_own_points_and_never_anothers(tmp_path: Path) -> None:
    front = _front(tmp_path)
    created = {"name": "a-l2", "dim": 3, "metadata": {"tag": "string"}}
    assert _call(front, "POST", "/v1/collections", created)[0] == 201
    assert _call(front, "POST", "/v1/collections", {"name": "b-cos", "dim": 5, "metric": "cosine"})[0] == 201
    assert _call(front, "POST", "/v1/collections", {"name": "a-l2", "dim": 3})[0] == 409
    status, error = _call(front, "POST", "/v1/collections", {"name": "x y", "dim": 3})
    assert status == 422 and error["field"] == "name"
    written = {"ids": [1, 2], "vectors": [[0, 0, 0], [1, 1, 1]], "metadata": [{"tag": "x"}, {"tag": "y"}]}
    assert _on(front, "a-l2", "upsert", written)[0] == 200
    assert _on(front, "b-cos", "upsert", {"ids": [1], "vectors": [[1, 0, 0, 0, 0]]})[0] == 200
    status, hits = _on(front, "a-l2", "search", {"vector": [1, 1, 1], "k": 5, "include": ["tag"]})
    assert status == 200 and hits["ids"] == [2, 1] and hits["metadata"] == [{"tag": "y"}, {"tag": "x"}]
    status, hits = _on(front, "b-cos", "search", {"vector": [2, 0, 0, 0, 0], "k": 5})
    assert hits["ids"] == [1] and hits["distances"] == [pytest.approx(1.0)]
    assert _on(front, "b-cos", "search", {"vector": [1, 1, 1], "k": 5})[0] == 422  # its own dim
    assert _on(front, "a-l2", "count", {"filter": {"tag": "x"}})[1]["count"] == 1
    assert _on(front, "a-l2", "delete", {"filter": {"tag": "x"}})[0] == 200
    assert _on(front, "a-l2", "scroll", {})[1]["points"] == [{"id": 2, "metadata": {"tag": "y"}}]
    assert _on(front, "b-cos", "points", {"ids": [1, 2]})[1]["points"] == [{"id": 1, "metadata": {}}]
    listed = _call(front, "GET", "/v1/collections")[1]["collections"]
    assert [(c["name"], c["dim"], c["metric"]) for c in listed] == [("a-l2", 3, "l2"), ("b-cos", 5, "cosine")]
    assert _call(front, "GET", "/v1/collections/a-l2")[1]["count"] == 1
    assert _call(front, "DELETE", "/v1/collections/a-l2")[0] == 200
    assert _on(front, "a-l2", "search", {"vector": [1, 1, 1]})[0] == 404
    assert _call(front, "POST", "/v1/collections", {"name": "a-l2", "dim": 3})[0] == 201
    assert _on(front, "a-l2", "count", {})[1]["count"] == 0  # nothing of the old one
    assert _call(front, "GET", "/v1/collections/nope")[0] == 404
    front.close()


SHAPES = {"s2-l2": (2, "l2"), "s3-ip": (3, "ip"), "s4-cos": (4, "cosine")}


class Collections(RuleBasedStateMachine):
    """Random creates, upserts, deletes, gets, counts, scrolls, searches and drops over collections
    of three shapes, each step sent to one of two router replicas' fronts over the same directory
    (one of them restarted now and then) and checked against dicts of numpy vectors: count, get
    and scroll exact (no duplicates) through either replica, searches equal to brute force, no id
    ever seen in another collection. A replica holds 2 collections at most: the others are let go
    and loaded again from disk as they are asked."""

    names = Bundle("names")

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="collections-"))
        self.fronts: list[CollectionsFront | ReplicaProcess] = [_front(self.root), self._second()]
        self.turn = 0
        self.held: dict[str, dict[int, tuple[np.ndarray, int]]] = {}

    def _second(self) -> CollectionsFront | ReplicaProcess:
        return _front(self.root)

    @property
    def front(self) -> CollectionsFront | ReplicaProcess:
        """The replica the next request reaches: each in turn."""
        self.turn += 1
        return self.fronts[self.turn % 2]

    def teardown(self) -> None:
        import shutil

        for front in self.fronts:
            front.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @rule(replica=st.integers(0, 1))
    def restart(self, replica: int) -> None:
        """A replica started again: it loads what it is asked for from disk."""
        self.fronts[replica].close()
        self.fronts[replica] = _front(self.root) if replica == 0 else self._second()

    @rule(target=names, name=st.sampled_from(sorted(SHAPES)))
    def create(self, name: str) -> str:
        dim, metric = SHAPES[name]
        status, _ = _call(self.front, "POST", "/v1/collections",
                          {"name": name, "dim": dim, "metric": metric, "metadata": {"tag": "int64"},
                           "index": "IVF8,Flat", "shards": 2, "grow_at": 1000})
        assert status == (409 if name in self.held else 201)
        self.held.setdefault(name, {})
        return name

    @rule(name=names, ids=st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True),
          seed=st.integers(0, 2**16), tag=st.integers(0, 3))
    def upsert(self, name: str, ids: list[int], seed: int, tag: int) -> None:
        dim, metric = SHAPES[name]
        vectors = np.random.default_rng(seed).normal(size=(len(ids), dim)).astype(np.float32)
        status, _ = _call(self.front, "POST", f"/v1/collections/{name}/upsert",
                          {"ids": ids, "vectors": vectors, "metadata": [{"tag": tag}] * len(ids)})
        assert status == (200 if name in self.held else 404)
        if name in self.held:
            if metric == "cosine":
                vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            self.held[name].update({i: (v, tag) for i, v in zip(ids, vectors, strict=True)})

    @rule(name=names, ids=st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True))
    def delete(self, name: str, ids: list[int]) -> None:
        status, _ = _call(self.front, "POST", f"/v1/collections/{name}/delete", {"ids": ids})
        assert status == (200 if name in self.held else 404)
        for i in ids:
            self.held.get(name, {}).pop(i, None)

    @rule(name=names)
    def fold(self, name: str) -> None:
        """The server's folder at work: a compaction, or, past `grow_at` rows, the build and swap."""
        entry = Catalogue(self.root, readonly=True).get(name)
        if entry is not None:
            fold(entry.path, entry.spec)

    @rule(name=names, seed=st.integers(0, 2**16))
    def grow(self, name: str, seed: int) -> None:
        """A bulk write past the collection's `grow_at`, then its fold: it is built as IVF8,Flat in 2
        shards, and every step after checks the built collection."""
        if name not in self.held:
            return
        dim, metric = SHAPES[name]
        ids = np.arange(1000, 2100)
        vectors = np.random.default_rng(seed).normal(size=(len(ids), dim)).astype(np.float32)
        for part in (slice(0, 600), slice(600, None)):
            status, _ = _call(self.front, "POST", f"/v1/collections/{name}/upsert",
                              {"ids": ids[part], "vectors": vectors[part],
                               "metadata": [{"tag": 1}] * len(ids[part])})
            assert status == 200
        if metric == "cosine":
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        self.held[name].update({int(i): (v, 1) for i, v in zip(ids, vectors, strict=True)})
        self.fold(name)
        stage = _call(self.front, "GET", f"/v1/collections/{name}")[1]
        assert stage["stage"] == "built" and stage["built_as"] == "IVF8,Flat"
        event("a collection grew into IVF8,Flat in 2 shards")

    @rule(name=consumes(names))
    def drop(self, name: str) -> None:
        status, _ = _call(self.front, "DELETE", f"/v1/collections/{name}")
        assert status == (200 if name in self.held else 404)
        self.held.pop(name, None)

    @rule(name=names, seed=st.integers(0, 2**16), k=st.integers(1, 8), tag=st.none() | st.integers(0, 3))
    def search(self, name: str, seed: int, k: int, tag: int | None) -> None:
        if name not in self.held:
            return
        dim, metric = SHAPES[name]
        query = np.random.default_rng(seed).normal(size=dim).astype(np.float32)
        body: dict = {"vector": query, "k": k, **({} if tag is None else {"filter": {"tag": tag}})}
        status, hits = _call(self.front, "POST", f"/v1/collections/{name}/search", body)
        assert status == 200
        points = {i: v for i, (v, t) in self.held[name].items() if tag is None or t == tag}
        if metric == "cosine":
            query = query / np.linalg.norm(query)
        scores = {i: float(v @ query) if metric != "l2" else float(((v - query) ** 2).sum())
                  for i, v in points.items()}
        want = sorted(scores, key=lambda i: (-scores[i] if metric != "l2" else scores[i], i))[:k]
        assert sorted(hits["ids"]) == sorted(want) or np.allclose(
            sorted(scores[i] for i in hits["ids"]), sorted(scores[i] for i in want), atol=1e-4)
        assert len(set(hits["ids"])) == len(hits["ids"]) and set(hits["ids"]) <= set(points)

    @invariant()
    def counts_gets_and_scrolls_are_exact(self) -> None:
        for name, points in self.held.items():
            assert _call(self.front, "POST", f"/v1/collections/{name}/count", {})[1]["count"] == len(points)
            walked, after = [], None
            while True:
                _, page = _call(self.front, "POST", f"/v1/collections/{name}/scroll",
                                {"after": after, "limit": 4 if len(points) < 100 else 500, "include": []})
                walked += [p["id"] for p in page["points"]]
                after = page["next"]
                if after is None:
                    break
            assert walked == sorted(points)
            asked = sorted(set(range(0, 41, 3)))
            _, got = _on(self.front, name, "points", {"ids": asked, "vectors": True})
            assert [p["id"] for p in got["points"]] == [i for i in asked if i in points]
            for point in got["points"]:
                vector, tag = points[point["id"]]
                assert point["metadata"] == {"tag": tag} and np.allclose(point["vector"], vector, atol=1e-6)


Collections.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_collections_match_a_plain_reference = Collections.TestCase


class KilledCollections(Collections):
    """The same steps and checks, the second replica a process of its own, SIGKILLed now and then:
    idle, or with a write of its in flight. A write answered 200 before the kill is in the reference
    like any other; one the kill cut off is read back through the other replica and must be there
    whole or not at all (one write is one log transaction), then it is the reference."""

    def _second(self) -> CollectionsFront | ReplicaProcess:
        return ReplicaProcess(self.root)

    @rule()
    def restart(self) -> None:  # type: ignore[override]
        """The in-process replica started again (the process is, by `sigkill`)."""
        super().restart(0)

    @rule(name=Collections.names, ids=st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True),
          seed=st.integers(0, 2**16), tag=st.integers(0, 3),
          after_ms=st.sampled_from([None, 0, 5, 30, 150, 1000]))
    def sigkill(self, name: str, ids: list[int], seed: int, tag: int, after_ms: int | None) -> None:
        """SIGKILL of the replica process, idle (`after_ms` None) or `after_ms` into an upsert of
        `ids` sent to it; then it is started again on the same directory."""
        import threading
        import time

        replica = self.fronts[1]
        assert isinstance(replica, ReplicaProcess)
        answer: list[tuple[int, dict] | BaseException] = []
        vectors = np.random.default_rng(seed).normal(size=(len(ids), SHAPES[name][0])).astype(np.float32)
        if after_ms is not None:
            def send() -> None:
                try:
                    answer.append(replica.call("POST", f"/v1/collections/{name}/upsert",
                                               {"ids": ids, "vectors": vectors,
                                                "metadata": [{"tag": tag}] * len(ids)}))
                except Exception as exc:  # noqa: BLE001 (cut off by the kill: its outcome is read back)
                    answer.append(exc)

            sender = threading.Thread(target=send)
            sender.start()
            time.sleep(after_ms / 1000)
        replica.kill()
        if after_ms is not None:
            sender.join()
            self._settle(name, ids, vectors, tag, answer[0])
        self.fronts[1] = self._second()
        event("the replica SIGKILLed " + ("idle" if after_ms is None else "with a write in flight"))

    def _settle(self, name: str, ids: list[int], vectors: np.ndarray, tag: int,
                outcome: tuple[int, dict] | BaseException) -> None:
        acknowledged = isinstance(outcome, tuple) and outcome[0] == 200
        if name not in self.held:
            assert not acknowledged
            return
        if SHAPES[name][1] == "cosine":
            vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        new = {i: (v, tag) for i, v in zip(ids, vectors, strict=True)}
        _, got = _on(self.fronts[0], name, "points", {"ids": ids, "vectors": True})
        now = {p["id"]: (np.asarray(p["vector"], np.float32), p["metadata"]["tag"]) for p in got["points"]}

        def same(state: dict[int, tuple[np.ndarray, int]]) -> bool:
            return set(now) == set(state) and all(
                now[i][1] == state[i][1] and np.allclose(now[i][0], state[i][0], atol=1e-6) for i in state)

        old = {i: self.held[name][i] for i in ids if i in self.held[name]}
        applied = same(new)
        assert applied or (not acknowledged and same(old)), "a write half applied, or acknowledged and lost"
        if applied:
            self.held[name].update(new)
        event("a write of the killed replica: " + ("acknowledged" if acknowledged else
                                                    "applied, not answered" if applied else "not applied"))


KilledCollections.TestCase.settings = settings(max_examples=10, stateful_step_count=30, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
test_a_sigkilled_replica_process_changes_nothing_acknowledged = KilledCollections.TestCase
