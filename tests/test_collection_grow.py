"""A collection grows: exact while small, folded (compacted) by its log, then built as its spec's
index behind the recall gate once it holds `grow_at` rows, every acknowledged write kept and no
deleted id back, answered by router replicas' fronts that move to each new version by themselves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from index_build.grow import fold, gate, live_rows
from shardserve.collection.catalogue import Catalogue
from shardserve.errors import ShardserveError
from tests.test_collections import _call, _front, _on

SPEC = {"name": "grows", "dim": 8, "metric": "l2", "metadata": {"tag": "int64"}, "index": "IVF16,Flat",
        "shards": 2, "grow_at": 1000}


def _upsert(front, ids: np.ndarray, rng: np.random.Generator, reference: dict) -> None:
    vectors = rng.normal(size=(len(ids), 8)).astype(np.float32)
    for start in range(0, len(ids), 500):
        part = slice(start, start + 500)
        body = {"ids": ids[part], "vectors": vectors[part],
                "metadata": [{"tag": int(i) % 5} for i in ids[part]]}
        assert _on(front, "grows", "upsert", body)[0] == 200
    reference.update({int(i): v for i, v in zip(ids, vectors, strict=True)})


def _check(front, reference: dict, exact: bool) -> float:
    """count, scroll and get exact; search recall@10 against brute force (1.0 when `exact`)."""
    assert _on(front, "grows", "count", {})[1]["count"] == len(reference)
    assert _on(front, "grows", "count", {"filter": {"tag": 3}})[1]["count"] == sum(
        1 for i in reference if i % 5 == 3)
    walked, after = [], None
    while True:
        page = _on(front, "grows", "scroll", {"after": after, "limit": 1000, "include": []})[1]
        walked += [p["id"] for p in page["points"]]
        if (after := page["next"]) is None:
            break
    assert walked == sorted(reference)
    some = sorted(reference)[::97] + [10**9]
    got = _on(front, "grows", "points", {"ids": some, "vectors": True, "include": ["tag"]})[1]["points"]
    assert [p["id"] for p in got] == some[:-1]
    assert all(np.allclose(p["vector"], reference[p["id"]]) and p["metadata"] == {"tag": p["id"] % 5}
               for p in got)
    ids = np.array(sorted(reference))
    matrix = np.stack([reference[i] for i in ids])
    hits = total = 0
    for seed in range(30):
        query = np.random.default_rng(seed).normal(size=8).astype(np.float32)
        status, answer = _on(front, "grows", "search", {"vector": query, "k": 10})
        assert status == 200 and len(set(answer["ids"])) == 10 and set(answer["ids"]) <= set(reference)
        truth = ids[np.argsort(((matrix - query) ** 2).sum(1), kind="stable")[:10]]
        hits += len(set(answer["ids"]) & set(truth.tolist()))
        total += 10
    recall = hits / total
    assert recall == 1.0 if exact else recall >= 0.95
    return recall


def test_a_collection_compacts_while_small_then_grows_into_its_index(tmp_path: Path) -> None:
    fronts = [_front(tmp_path), _front(tmp_path)]
    assert _call(fronts[0], "POST", "/v1/collections", SPEC)[0] == 201
    path = Catalogue(tmp_path, readonly=True).get("grows").path
    from shardserve.collection.spec import CollectionSpec

    spec = CollectionSpec(**SPEC)
    rng, reference = np.random.default_rng(1), {}
    _upsert(fronts[0], np.arange(0, 600), rng, reference)
    assert _on(fronts[1], "grows", "delete", {"ids": list(range(0, 600, 7))})[0] == 200
    for i in range(0, 600, 7):
        reference.pop(i)
    folded = fold(path, spec)  # 514 rows: compacted, still exact
    assert folded is not None and folded.index_factory == "Flat" and folded.num_vectors == len(reference)
    assert fold(path, spec) is None  # nothing new in the log
    for front in fronts:
        assert _call(front, "GET", "/v1/collections/grows")[1]["stage"] == "exact"
        _check(front, reference, exact=True)
    _upsert(fronts[1], np.arange(500, 1300), rng, reference)  # overwrites 500..599 with new vectors
    assert _on(fronts[0], "grows", "delete", {"ids": [501, 1299]})[0] == 200
    for i in (501, 1299):
        reference.pop(i)
    rows = live_rows(path)
    assert rows.ids.tolist() == sorted(reference)
    grown = fold(path, spec)
    assert grown is not None and grown.index_factory == "IVF16,Flat" and len(grown.shards) == 2
    assert grown.num_vectors == len(reference) and grown.build.params["recall_at_10"] >= 0.99
    # writes after the fold's log position are applied on top of the new version
    _upsert(fronts[0], np.arange(2000, 2050), rng, reference)
    _upsert(fronts[1], np.arange(100, 300), rng, reference)  # overwrites: each id may change shards
    assert _on(fronts[1], "grows", "delete", {"ids": [2000, 7]})[0] == 200  # 7 was deleted before too
    reference.pop(2000)
    for front in fronts:
        described = _call(front, "GET", "/v1/collections/grows")[1]
        assert described["stage"] == "built" and described["built_as"] == "IVF16,Flat"
        assert described["count"] == len(reference)
        _check(front, reference, exact=False)
    again = fold(path, spec)  # a grown collection's next fold is a compaction of its kind
    assert again is not None and again.index_factory == "IVF16,Flat" and again.num_vectors == len(reference)
    _check(fronts[1], reference, exact=False)
    for front in fronts:
        front.close()


def test_the_gate_refuses_an_index_that_cannot_reach_the_target() -> None:
    import faiss

    vectors = np.random.default_rng(0).normal(size=(2000, 16)).astype(np.float32)
    index = faiss.index_factory(16, "IVF32,PQ2x4fs")
    index.train(vectors)
    index.add(vectors)
    with pytest.raises(ShardserveError, match="not published"):
        gate([index], vectors, "l2")
    exact = faiss.index_factory(16, "IVF32,Flat")
    exact.train(vectors)
    exact.add(vectors)
    setting, recall = gate([exact], vectors, "l2")
    assert recall >= 0.99 and 16 <= setting["nprobe"] <= 32


def test_a_growth_that_cannot_be_built_compacts_exact_instead(tmp_path: Path) -> None:
    from shardserve.collection.spec import CollectionSpec

    spec = dict(SPEC, name="too-many-lists", index="IVF4096,Flat")  # 4,096 lists, ~1,100 rows to train
    front = _front(tmp_path)
    assert _call(front, "POST", "/v1/collections", spec)[0] == 201
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(1100, 8)).astype(np.float32)
    mismatched = {"ids": list(range(1100)), "vectors": vectors[:1000]}  # refused whole: nothing of it written
    assert _on(front, "too-many-lists", "upsert", mismatched)[0] == 422
    for start in (0, 600):
        body = {"ids": list(range(start, min(start + 600, 1100))), "vectors": vectors[start:start + 600]}
        assert _on(front, "too-many-lists", "upsert", body)[0] == 200
    path = Catalogue(tmp_path, readonly=True).get("too-many-lists").path
    with pytest.raises(ShardserveError, match="training vectors"):
        fold(path, CollectionSpec(**spec))  # told to no one: the failure is the caller's
    said: list[tuple[int, str]] = []
    folded = fold(path, CollectionSpec(**spec), refused=lambda rows, exc: said.append((rows, str(exc))))
    assert said and said[0][0] == 1100 and folded is not None and folded.index_factory == "Flat"
    described = _call(front, "GET", "/v1/collections/too-many-lists")[1]
    assert described["stage"] == "exact" and described["count"] == 1100
    front.close()


_FOLDER = """
import sys, time
import index_build.grow as grow
from shardserve.collection.spec import CollectionSpec

checked = grow.gate

def gate_then_wait(*args, **kwargs):  # the grown shards are written and gated; never published
    answer = checked(*args, **kwargs)
    print("gated", flush=True)
    time.sleep(600)
    return answer

grow.gate = gate_then_wait
grow.fold(sys.argv[1], CollectionSpec.model_validate_json(sys.argv[2]))
"""


def test_a_first_build_killed_midway_leaves_the_exact_collection_whole(tmp_path: Path) -> None:
    """SIGKILL of the process building a collection for the first time, its shards written: the
    collection is still its exact version, whole (every acknowledged point, answered exactly);
    while the builder lived no other fold ran beside it; the next fold sweeps what it left and
    builds the collection."""
    import os
    import signal
    import subprocess
    import sys

    from shardserve.collection.spec import CollectionSpec

    front = _front(tmp_path)
    assert _call(front, "POST", "/v1/collections", SPEC)[0] == 201
    rng, reference = np.random.default_rng(5), {}
    _upsert(front, np.arange(0, 1200), rng, reference)
    path = Catalogue(tmp_path, readonly=True).get("grows").path
    spec = CollectionSpec(**SPEC)
    child = subprocess.Popen([sys.executable, "-c", _FOLDER, str(path), spec.model_dump_json()],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "gated"
        assert fold(path, spec) is None  # the builder holds the collection's fold lock
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    versions = sorted(p for p in (path / "versions").iterdir())
    assert [p for p in versions if not (p / "manifest.json").exists()]  # the killed build's directory
    assert _call(front, "GET", "/v1/collections/grows")[1]["stage"] == "exact"
    _check(front, reference, exact=True)
    grown = fold(path, spec)
    assert grown is not None and grown.index_factory == "IVF16,Flat"
    assert all((p / "manifest.json").exists() for p in (path / "versions").iterdir())
    _check(front, reference, exact=False)
    front.close()


def test_the_servers_folder_folds_what_is_due_and_says_what_it_refused(tmp_path: Path) -> None:
    from serving.compactor import CollectionsFolder

    front = _front(tmp_path)
    said: list[str] = []
    folder = CollectionsFolder(str(tmp_path), at_ops=500, backend="local", say=said.append)
    assert folder.run_once() == 0  # no collection, nothing due
    for spec in (SPEC, dict(SPEC, name="cannot-grow", index="IVF4096,Flat"), dict(SPEC, name="quiet")):
        assert _call(front, "POST", "/v1/collections", spec)[0] == 201
    rng, reference = np.random.default_rng(9), {}
    _upsert(front, np.arange(0, 1100), rng, reference)  # "grows": past its grow_at
    vectors = rng.normal(size=(1100, 8)).astype(np.float32)
    for start in (0, 600):
        body = {"ids": list(range(start, min(start + 600, 1100))), "vectors": vectors[start:start + 600]}
        assert _on(front, "cannot-grow", "upsert", body)[0] == 200
    assert _on(front, "quiet", "upsert", {"ids": [1], "vectors": vectors[:1]})[0] == 200  # not due
    assert folder.run_once() == 2
    stages = {name: _call(front, "GET", f"/v1/collections/{name}")[1]["stage"]
              for name in ("grows", "cannot-grow", "quiet")}
    assert stages == {"grows": "built", "cannot-grow": "exact", "quiet": "exact"}
    assert any("'cannot-grow' not grown at 1100 points" in line for line in said)
    assert folder.run_once() == 0  # nothing new: nothing due, the refused one not tried again
    _check(front, reference, exact=False)
    front.close()
