"""Chroma's API on the collections of one router replica (deployments.chroma over a real
CollectionsFront: real FAISS, real write logs, no Ray), and its plain parts: where, regex, the
catalogue. Chroma's own client and test suite run against `shardserve serve` in `make test-chroma`."""

from __future__ import annotations

import asyncio
import base64
import struct
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.chroma import chroma_front
from deployments.collections import CollectionsFront
from deployments.config import AppArgs
from shardserve.chroma.catalogue import ChromaCatalogue, Exists, native_name
from shardserve.chroma.front import check_name, configured
from shardserve.chroma.records import ChromaRefusal, merged
from shardserve.chroma.where import BadWhere, matches, matches_document
from shardserve.query.api import Limits

DB = "/tenants/default_tenant/databases/default_database"


class Chroma:
    """The Chroma routes of one replica, called as its door would."""

    def __init__(self, root: Path, **args: object):
        app = AppArgs(**{"index": "-", "chroma_allow_reset": True, **args})  # type: ignore[arg-type]
        limits = Limits(app.max_k, app.max_vectors, app.max_work, app.max_body_bytes, app.max_write_points,
                        200_000, max_page=app.max_page)
        self.native = CollectionsFront(root, app, limits)
        self.front = chroma_front(self.native, app)

    def __call__(self, method: str, path: str, body: object = None, query: str = "") -> tuple[int, object]:
        raw = b"" if body is None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        status, answer, headers = asyncio.run(self.front.respond(method, path, query, raw))
        decoded = orjson.loads(answer)
        if status >= 400:
            assert set(decoded) == {"error", "message"} and "chroma-trace-id" in headers
        return status, decoded

    def create(self, name: str, space: str = "l2") -> str:
        status, made = self("POST", f"{DB}/collections", {"name": name, "metadata": {"hnsw:space": space}})
        assert status == 200, made
        return made["id"]  # type: ignore[index]

    def on(self, collection: str, op: str, body: object) -> tuple[int, object]:
        return self("POST", f"{DB}/collections/{collection}/{op}", body)


@pytest.fixture
def chroma(tmp_path: Path) -> Chroma:
    return Chroma(tmp_path)


def _distance(metric: str, q: np.ndarray, v: np.ndarray) -> float:
    q64, v64 = q.astype(np.float64), v.astype(np.float64)
    if metric == "l2":
        return float(np.sum((q64 - v64) ** 2))
    if metric == "ip":
        return float(1 - q64 @ v64)
    return float(1 - q64 @ v64 / (np.linalg.norm(q64) * np.linalg.norm(v64)))


@pytest.mark.parametrize("space", ["l2", "ip", "cosine"])
def test_records_answer_in_insertion_order_with_chromas_distances(chroma: Chroma, space: str) -> None:
    cid = chroma.create(f"points-{space}", space)
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(40, 6)).astype(np.float32)
    ids = [f"r{i:02d}" for i in range(40)][::-1]  # inserted in descending name order
    meta = [{"i": i, "even": i % 2 == 0, "tags": ["a", "b"] if i % 3 == 0 else ["c"]} for i in range(40)]
    encoded = [base64.b64encode(struct.pack("<6f", *v)).decode() for v in vectors[:20]]
    assert chroma.on(cid, "add", {"ids": ids[:20], "embeddings": encoded, "metadatas": meta[:20],
                                  "documents": [f"doc {i}" for i in range(20)]})[0] == 200
    assert chroma.on(cid, "add", {"ids": ids[20:], "embeddings": vectors[20:].tolist(),
                                  "metadatas": meta[20:], "documents": None})[0] == 200
    status, count = chroma("GET", f"{DB}/collections/{cid}/count")
    assert (status, count) == (200, 40)
    status, got = chroma.on(cid, "get", {"include": ["embeddings", "metadatas", "documents"]})
    assert got["ids"] == ids  # type: ignore[index]
    np.testing.assert_allclose(np.asarray(got["embeddings"]), vectors, rtol=1e-5)  # type: ignore[index]
    assert got["documents"][20:] == [None] * 20  # type: ignore[index]
    status, page = chroma.on(cid, "get", {"where": {"even": True}, "limit": 3, "offset": 2, "include": []})
    assert page["ids"] == [ids[i] for i in range(40) if i % 2 == 0][2:5]  # type: ignore[index]
    queries = vectors[:3] + 0.01
    status, found = chroma.on(cid, "query", {"query_embeddings": queries.tolist(), "n_results": 5,
                                             "where": {"tags": {"$contains": "a"}},
                                             "include": ["distances", "metadatas"]})
    assert status == 200, found
    allowed = [i for i in range(40) if i % 3 == 0]
    for q, (got_ids, got_distances) in enumerate(zip(found["ids"], found["distances"], strict=True)):  # type: ignore[index]
        exact = sorted((_distance(space, queries[q], vectors[i]), ids[i]) for i in allowed)[:5]
        assert got_ids == [sid for _, sid in exact]
        np.testing.assert_allclose(got_distances, [d for d, _ in exact], rtol=1e-5, atol=1e-6)


def test_writes_follow_chromas_rules_add_ignores_update_merges_delete_filters(chroma: Chroma) -> None:
    cid = chroma.create("rules")
    first = {"ids": ["a", "b"], "embeddings": [[1, 0], [0, 1]], "documents": ["one", "two"],
             "metadatas": [{"k": 1, "s": "x"}, None]}
    assert chroma.on(cid, "add", first)[0] == 200
    added = {"ids": ["a", "c"], "embeddings": [[9, 9], [1, 1]], "metadatas": None}
    assert chroma.on(cid, "add", added)[0] == 200
    _, got = chroma.on(cid, "get", {"ids": ["a", "c"], "include": ["embeddings", "metadatas", "documents"]})
    assert got["ids"] == ["a", "c"] and got["embeddings"][0] == [1, 0]  # type: ignore[index]  # add ignored "a"
    assert got["metadatas"] == [{"k": 1, "s": "x"}, None]  # type: ignore[index]
    updated = {"ids": ["a", "zz"], "metadatas": [{"k": None, "t": True}, {"q": 1}]}
    assert chroma.on(cid, "update", updated)[0] == 200
    assert chroma.on(cid, "upsert", {"ids": ["b", "d"], "embeddings": [[0, 2], [3, 3]],
                                     "metadatas": [{"n": 2.5}, {"n": 1}]})[0] == 200
    _, got = chroma.on(cid, "get", {"include": ["metadatas", "documents", "embeddings"]})
    assert got["ids"] == ["a", "b", "c", "d"]  # type: ignore[index]  # an update keeps its place
    assert got["metadatas"] == [{"s": "x", "t": True}, {"n": 2.5}, None, {"n": 1}]  # type: ignore[index]
    assert got["documents"] == ["one", "two", None, None]  # type: ignore[index]
    assert got["embeddings"][1] == [0, 2]  # type: ignore[index]
    status, deleted = chroma.on(cid, "delete", {"where": {"n": {"$gte": 1}}, "where_document": None})
    assert (status, deleted) == (200, {"deleted": 2})
    status, error = chroma.on(cid, "add", {"ids": ["e"], "embeddings": [[1, 2, 3]]})
    assert status == 400 and "dimension of 2, got 3" in error["message"]  # type: ignore[index]
    assert chroma("GET", f"{DB}/collections/{cid}/count") == (200, 2)


def test_collections_catalogue_over_the_api(chroma: Chroma, tmp_path: Path) -> None:
    cid = chroma.create("first")
    assert chroma("POST", f"{DB}/collections", {"name": "first"})[0] == 409
    status, again = chroma("POST", f"{DB}/collections", {"name": "first", "get_or_create": True,
                                                        "metadata": {"other": 1}})
    assert again["id"] == cid and again["metadata"] == {"hnsw:space": "l2"}  # type: ignore[index]
    assert chroma("POST", f"{DB}/collections", {"name": "x", "metadata": None})[0] == 400
    assert chroma("POST", f"{DB}/collections", {"name": "empty-meta", "metadata": {}})[0] == 400
    status, model = chroma("GET", f"{DB}/collections/first")
    assert model["configuration_json"]["hnsw"]["space"] == "l2" and model["dimension"] is None  # type: ignore[index]
    chroma.on(cid, "add", {"ids": ["p"], "embeddings": [[0.5, 0.5, 0.5]]})
    assert chroma("GET", f"{DB}/collections/by-id/{cid}")[1]["dimension"] == 3  # type: ignore[index]
    modified = {"new_name": "renamed", "new_metadata": {"v": 2}}
    assert chroma("PUT", f"{DB}/collections/{cid}", modified)[0] == 200
    assert chroma("GET", f"{DB}/collections/first")[0] == 404
    assert chroma("GET", f"{DB}/collections_count") == (200, 1)
    # the records live in a native collection, visible through the native API
    described = asyncio.run(chroma.front.native("GET", native_name(cid), None))
    assert described["count"] == 1  # type: ignore[index]
    assert chroma("DELETE", f"{DB}/collections/renamed") == (200, {})
    status, error = chroma("DELETE", f"{DB}/collections/renamed")
    assert status == 404 and "does not exist" in error["message"]  # type: ignore[index]
    assert chroma.on(cid, "get", {})[0] == 404
    assert chroma("POST", "/tenants", {"name": "acme"}) == (200, {})
    assert chroma("POST", "/tenants/acme/databases", {"name": "prod"}) == (200, {})
    assert chroma("GET", "/tenants/acme/databases")[1][0]["name"] == "prod"  # type: ignore[index]
    assert chroma("POST", "/reset") == (200, True)
    assert chroma("GET", "/tenants/acme")[0] == 404
    assert chroma("GET", f"{DB}")[0] == 200


def test_reset_is_refused_unless_the_server_allows_it(tmp_path: Path) -> None:
    closed = Chroma(tmp_path, chroma_allow_reset=False)
    status, error = closed("POST", "/reset")
    assert status == 403 and "chroma_allow_reset" in error["message"]  # type: ignore[index]


def test_where_follows_chromas_types_and_missing_keys() -> None:
    record = {"n": 3, "f": 2.5, "b": True, "s": "x", "tags": ["a", "b"]}
    assert matches({"n": 3.0}, record, None)  # int and float compare as numbers
    assert not matches({"b": 1}, record, None)  # a bool is never a number
    assert matches({"missing": {"$ne": 1}}, record, None)  # $ne and $nin match a missing key
    assert matches({"missing": {"$nin": [1]}}, record, None)
    assert not matches({"s": {"$gt": 1}}, record, None)  # numbers only
    assert matches({"tags": {"$contains": "a"}}, record, None) and not matches({"tags": "a"}, record, None)
    assert matches({"$or": [{"n": 1}, {"f": {"$lt": 3}}]}, record, None)
    assert not matches({"$and": [{"n": 3}, {"s": "y"}]}, record, None)
    assert matches_document({"$not_contains": "z"}, None) and not matches_document({"$contains": "z"}, None)
    assert matches({"#document": {"$contains": "Cat"}}, {}, "a Cat")
    assert not matches_document({"$contains": "cat"}, "a Cat")  # case-sensitive
    with pytest.raises(BadWhere):
        matches({"n": {"$between": 1}}, record, None)


def test_a_regex_is_rusts_syntax_matched_in_linear_time() -> None:
    """RE2 takes a flag group in mid-pattern as Rust's regex does (Chroma's own test uses one), and
    a pattern that backtracks Python's re exponentially is answered (a client cannot stall a replica)."""
    assert [matches_document({"$regex": "(?i)c(?-i)at"}, s) for s in ["cat", "Cat", "CAT", "cAT"]] == \
        [True, True, False, False]
    assert matches_document({"$regex": "a(?i)b|c"}, "C")  # the flags reach the other alternative
    assert not matches_document({"$regex": "(a+)+$"}, "a" * 100_000 + "b")
    assert matches_document({"$not_regex": "x"}, None) and not matches_document({"$regex": "x"}, None)
    with pytest.raises(BadWhere):
        matches_document({"$regex": "(?<=x)y"}, "xy")  # no look-behind in Rust's syntax either


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab()|?:i-[]\\*+{}$^", max_size=24), st.text(alphabet="ab", max_size=64))
def test_any_pattern_is_a_match_a_miss_or_a_bad_where(pattern: str, document: str) -> None:
    try:
        assert isinstance(matches_document({"$regex": pattern}, document), bool)
    except BadWhere as refused:
        assert "invalid regex" in str(refused)


def test_update_merges_metadata_key_by_key() -> None:
    assert merged({"a": 1, "b": 2}, {"b": None, "c": 3}) == {"a": 1, "c": 3}
    assert merged({"a": 1}, None) == {"a": 1}
    assert merged({"a": 1}, {"a": None}) is None


def test_names_and_configuration_are_chromas() -> None:
    assert check_name("my-coll.1") == "my-coll.1"
    for bad in ["ab", "a..b", "-abc", "10.0.0.1", "x" * 513]:
        with pytest.raises(ChromaRefusal):
            check_name(bad)
    assert configured(None, {"hnsw:space": "cosine", "hnsw:M": 8})["hnsw"] == {
        "space": "cosine", "ef_construction": 100, "ef_search": 100, "max_neighbors": 8,
        "sync_threshold": 1000, "resize_factor": 1.2}
    assert configured({"hnsw": {"space": "ip"}}, {"hnsw:space": "cosine"})["hnsw"]["space"] == "ip"
    with pytest.raises(ChromaRefusal):
        configured({"hnsw": {"space": "hamming"}}, None)


def test_the_catalogue_survives_a_reopen_and_names_its_orphans(tmp_path: Path) -> None:
    catalogue = ChromaCatalogue(tmp_path)
    made = catalogue.create("default_tenant", "default_database", "kept", {"a": 1}, {"hnsw": None})
    gone = catalogue.create("default_tenant", "default_database", "gone", None, {})
    with pytest.raises(Exists):
        catalogue.create("default_tenant", "default_database", "kept", None, {})
    assert catalogue.delete(gone.id) is not None
    catalogue.close()
    reopened = ChromaCatalogue(tmp_path)
    assert reopened.named("default_tenant", "default_database", "kept") == made
    assert reopened.orphans([made.native, gone.native, "docs"]) == [gone.native]


def test_a_write_racing_a_delete_on_another_replica_never_brings_the_record_back(tmp_path: Path) -> None:
    """Two router replicas (two fronts on one directory): an update that read a record, then a delete
    of it by the other replica, then the update's write. The write lock spans replicas and the
    read, so the update either wrote before the delete or finds the record gone: it never comes back."""
    one, two = Chroma(tmp_path), Chroma(tmp_path)
    cid = one.create("raced")
    assert one.on(cid, "add", {"ids": ["x"], "embeddings": [[1.0, 2.0]], "metadatas": [{"a": 1}]})[0] == 200

    async def race() -> None:
        original = one.front.native
        paused, go = asyncio.Event(), asyncio.Event()

        async def slow(method: str, route: str, body: object, reserved: bool = False) -> object:
            answer = await original(method, route, body, reserved)
            if route.endswith("/points"):  # the update has read the record: hold it there
                paused.set()
                await go.wait()
            return answer

        one.front.native = slow
        update = asyncio.create_task(one.front.respond("POST", f"{DB}/collections/{cid}/update", "",
                                                       orjson.dumps({"ids": ["x"], "metadatas": [{"b": 2}]})))
        await paused.wait()
        delete = asyncio.create_task(two.front.respond("POST", f"{DB}/collections/{cid}/delete", "",
                                                       orjson.dumps({"ids": ["x"]})))
        await asyncio.sleep(0.3)
        assert not delete.done()  # the other replica waits for the lock
        go.set()
        assert (await update)[0] == 200 and (await delete)[0] == 200

    asyncio.run(race())
    assert two.on(cid, "get", {})[1]["ids"] == []  # type: ignore[index]


def test_a_batch_is_refused_whole_and_a_refused_first_write_sets_no_dimension(chroma: Chroma) -> None:
    cid = chroma.create("whole")
    batch = {"ids": [f"r{i}" for i in range(300)], "embeddings": [[float(i), 1.0] for i in range(300)],
             "documents": ["d"] * 299 + ["x" * 9000]}
    status, error = chroma.on(cid, "add", batch)
    assert status == 400 and "more than 8192 bytes" in error["message"]  # type: ignore[index]
    assert chroma("GET", f"{DB}/collections/by-id/{cid}")[1]["dimension"] is None  # type: ignore[index]
    assert chroma("GET", f"{DB}/collections/{cid}/count") == (200, 0)
    too_many = {"ids": [f"r{i}" for i in range(1001)], "embeddings": [[1.0, 1.0]] * 1001}
    assert "exceeds maximum batch size 1000" in chroma.on(cid, "add", too_many)[1]["message"]  # type: ignore[index]
    assert chroma("GET", "/pre-flight-checks")[1]["max_batch_size"] == 1000  # type: ignore[index]


def test_a_filter_is_checked_whole_and_bounded_before_any_record_is(chroma: Chroma) -> None:
    cid = chroma.create("checked")
    chroma.on(cid, "add", {"ids": ["a"], "embeddings": [[1.0]], "metadatas": [{"v": 5}]})
    for where in [{"$and": [{"zz": 1}, {"a": {"$bogus": 1}}]}, {"$not": {"v": 5}},
                  {"v": {"$in": list(range(300))}}, {"$or": [{"v": i} for i in range(300)]}]:
        status, error = chroma.on(cid, "get", {"where": where})
        assert status == 400, where
    # checked though no record has a document
    assert chroma.on(cid, "get", {"where_document": {"$regex": "("}})[0] == 400
    assert chroma.on(cid, "get", {"where": {"v": {"$in": [5.0]}}})[1]["ids"] == []  # type: ignore[index]
    assert chroma.on(cid, "get", {"where": {"v": {"$in": [5]}}})[1]["ids"] == ["a"]  # type: ignore[index]


def test_the_native_api_cannot_take_a_name_chromas_collections_keep(chroma: Chroma) -> None:
    cid = chroma.create("kept")
    status, error = asyncio.run(_native_create(chroma, native_name(cid)))
    assert status == 422 and "kept for the collections of Chroma" in error
    # and the native collections a reset sweeps are only Chroma's own
    asyncio.run(chroma.front.native("POST", "", {"name": "chroma-mydata", "dim": 2}))
    assert chroma("POST", "/reset") == (200, True)
    names = [c["name"] for c in asyncio.run(chroma.front.native("GET", "", None))["collections"]]  # type: ignore[index]
    assert names == ["chroma-mydata"]


async def _native_create(chroma: Chroma, name: str) -> tuple[int, str]:
    from shardserve.query.api import ApiError

    try:
        await chroma.front.native("POST", "", {"name": name, "dim": 2})
    except ApiError as error:
        return error.status, error.message
    return 201, ""


def test_a_cached_filter_never_answers_past_a_write_of_another_replica(tmp_path: Path) -> None:
    """A replica keeps its walk of the records and its filters' answers under the log position they
    are the state at: a write through another replica moves the position, and the next filtered read
    walks again."""
    one, two = Chroma(tmp_path), Chroma(tmp_path)
    cid = one.create("cached")
    one.on(cid, "add", {"ids": ["a"], "embeddings": [[1.0, 0.0]], "metadatas": [{"k": 1}]})
    where = {"where": {"k": 1}, "include": []}
    assert one.on(cid, "get", where)[1]["ids"] == ["a"]  # type: ignore[index]
    assert one.on(cid, "get", where)[1]["ids"] == ["a"]  # type: ignore[index]  # from the cache
    two.on(cid, "add", {"ids": ["b"], "embeddings": [[0.0, 1.0]], "metadatas": [{"k": 1}]})
    assert one.on(cid, "get", where)[1]["ids"] == ["a", "b"]  # type: ignore[index]
    two.on(cid, "update", {"ids": ["a"], "metadatas": [{"k": 2}]})
    assert one.on(cid, "get", where)[1]["ids"] == ["b"]  # type: ignore[index]
    status, found = one.on(cid, "query", {"query_embeddings": [[1.0, 0.0]], "n_results": 2, **where})
    assert found["ids"] == [["b"]]  # type: ignore[index]


@pytest.mark.parametrize("in_process", [True, False])
def test_a_filter_passing_many_ids_is_searched_exactly_over_base_and_delta(chroma: Chroma, in_process: bool
                                                                           ) -> None:
    """2,500 records pass the filter, some folded into the base, some in the delta, some deleted
    since. In-process the shards search among all of them at once (`Among`); through the routes (a
    collection served apart) the native search is asked in parts of records.ID_PART ids, merged by
    merge_topk. Either answer is brute force's over the passing records, with Chroma's distances."""
    from index_build.grow import fold
    from shardserve.collection.catalogue import Catalogue

    searched: list[int] = []  # the ids each in-process search was among
    given = chroma.front.search

    async def counted(native: str, matrix: np.ndarray, k: int, among: object) -> object:
        searched.append(len(among.ids))  # type: ignore[attr-defined]
        return await given(native, matrix, k, among)  # type: ignore[misc]

    chroma.front.search = counted if in_process else None
    cid = chroma.create("parts")
    rng = np.random.default_rng(5)
    vectors = rng.normal(size=(3000, 8)).astype(np.float32)
    for start in range(0, 3000, 1000):
        chroma.on(cid, "add", {"ids": [f"p{i}" for i in range(start, start + 1000)],
                               "embeddings": vectors[start:start + 1000].tolist(),
                               "metadatas": [{"keep": i % 6 != 0} for i in range(start, start + 1000)]})
        if start == 1000:  # the first 2,000 folded into the base, the rest in the delta
            entry = Catalogue(chroma.native.root, readonly=True).live()[0]  # type: ignore[arg-type]
            assert fold(entry.path, entry.spec) is not None
    gone = [i for i in range(0, 3000, 50) if i % 6 != 0]  # deleted in the base and in the delta
    assert chroma.on(cid, "delete", {"ids": [f"p{i}" for i in gone]})[0] == 200
    queries = rng.normal(size=(3, 8)).astype(np.float32)
    status, found = chroma.on(cid, "query", {"query_embeddings": queries.tolist(), "n_results": 7,
                                             "where": {"keep": True}, "include": ["distances"]})
    assert status == 200
    kept = [i for i in range(3000) if i % 6 != 0 and i not in gone]
    for q, got in enumerate(found["ids"]):  # type: ignore[index]
        exact = sorted(kept, key=lambda i: _distance("l2", queries[q], vectors[i]))[:7]
        assert got == [f"p{i}" for i in exact]
        np.testing.assert_allclose(found["distances"][q],  # type: ignore[index]
                                   [_distance("l2", queries[q], vectors[i]) for i in exact], rtol=1e-6)
    assert searched == ([len(kept)] if in_process else [])


def test_n_results_past_max_k_is_scored_here_exactly(chroma: Chroma) -> None:
    """Past the native max_k (100) the router scores the records itself, in bounded blocks."""
    cid = chroma.create("many", "ip")
    rng = np.random.default_rng(8)
    vectors = rng.normal(size=(300, 5)).astype(np.float32)
    chroma.on(cid, "add", {"ids": [f"m{i}" for i in range(300)], "embeddings": vectors.tolist()})
    queries = rng.normal(size=(70, 5)).astype(np.float32)  # more than one block of queries
    status, found = chroma.on(cid, "query", {"query_embeddings": queries.tolist(), "n_results": 150,
                                             "include": ["distances"]})
    assert status == 200
    for q in (0, 69):
        exact = sorted(range(300), key=lambda i: _distance("ip", queries[q], vectors[i]))[:150]
        assert found["ids"][q] == [f"m{i}" for i in exact]  # type: ignore[index]
        np.testing.assert_allclose(found["distances"][q],  # type: ignore[index]
                                   [_distance("ip", queries[q], vectors[i]) for i in exact], atol=1e-6)


def test_a_database_needs_its_tenant(chroma: Chroma) -> None:
    status, error = chroma("POST", "/tenants/nobody/databases", {"name": "prod"})
    assert status == 404 and "Tenant [nobody]" in error["message"]  # type: ignore[index]
    assert chroma("POST", "/tenants/default_tenant/databases", {"name": "default_database"})[0] == 409


def test_a_query_the_native_search_refuses_is_refused_in_process_too(chroma: Chroma) -> None:
    """The in-process search runs the native checks of a batch: an overflowing norm (float32 squared
    distances would all be inf, and nothing answered) or a zero query under cosine is a 400."""
    for space, query in (("l2", [1e20, 0.0, 0.0]), ("cosine", [0.0, 0.0, 0.0])):
        cid = chroma.create(f"checked-{space}", space)
        chroma.on(cid, "add", {"ids": ["a", "b"], "embeddings": [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]})
        status, refused = chroma.on(cid, "query", {"query_embeddings": [query], "n_results": 1})
        assert status == 400 and refused["error"] == "InvalidArgumentError", refused  # type: ignore[index]


@pytest.mark.parametrize("space", ["l2", "cosine"])
def test_a_collection_grown_into_two_shards_answers_as_chromas_reference(tmp_path: Path, space: str) -> None:
    """Past `chroma_grow_at` a Chroma collection is built in `chroma_shards` (2) shards (the folder's
    fold, run here): filtered queries search among the filter's ids in both shards and merge them,
    gets keep insertion order, counts and deletes hold across the shards, and writes after the
    growth land in the shards' deltas."""
    from index_build.grow import fold
    from shardserve.collection.catalogue import Catalogue

    chroma = Chroma(tmp_path, chroma_grow_at=1000)
    cid = chroma.create(f"grown-{space}", space)
    rng = np.random.default_rng(11)
    vectors = rng.normal(size=(1300, 8)).astype(np.float32)
    ids = [f"g{i}" for i in range(1300)]
    for start in range(0, 1200, 400):
        part = slice(start, start + 400)
        chroma.on(cid, "add", {"ids": ids[part], "embeddings": vectors[part].tolist(),
                               "metadatas": [{"k": i % 5} for i in range(start, start + 400)]})
    entry = Catalogue(tmp_path, readonly=True).live()[0]
    grown = fold(entry.path, entry.spec)
    assert grown is not None and len(grown.shards) == 2 and grown.index_factory == "Flat"
    chroma.on(cid, "add", {"ids": ids[1200:], "embeddings": vectors[1200:].tolist(),  # into the deltas
                           "metadatas": [{"k": i % 5} for i in range(1200, 1300)]})
    gone = list(range(0, 1300, 7))
    assert chroma.on(cid, "delete", {"ids": [ids[i] for i in gone]})[0] == 200
    kept = [i for i in range(1300) if i not in gone]
    assert chroma("GET", f"{DB}/collections/{cid}/count") == (200, len(kept))
    status, page = chroma.on(cid, "get", {"where": {"k": 2}, "limit": 50, "offset": 100, "include": []})
    assert page["ids"] == [ids[i] for i in kept if i % 5 == 2][100:150]  # type: ignore[index]
    queries = rng.normal(size=(4, 8)).astype(np.float32)
    status, found = chroma.on(cid, "query", {"query_embeddings": queries.tolist(), "n_results": 9,
                                             "where": {"k": {"$in": [1, 3]}}, "include": ["distances"]})
    assert status == 200, found
    allowed = [i for i in kept if i % 5 in (1, 3)]
    for q in range(4):
        exact = sorted(allowed, key=lambda i: _distance(space, queries[q], vectors[i]))[:9]
        assert found["ids"][q] == [ids[i] for i in exact]  # type: ignore[index]
        np.testing.assert_allclose(found["distances"][q],  # type: ignore[index]
                                   [_distance(space, queries[q], vectors[i]) for i in exact],
                                   rtol=1e-5, atol=1e-6)


def test_a_deleted_collections_write_lock_file_goes_with_it(chroma: Chroma, tmp_path: Path) -> None:
    """Each collection's writes take an flock on a file of its own: deleting the collection deletes
    it (and a reset every one), so a server that makes and drops collections keeps no trail of them."""
    kept, dropped = chroma.create("kept"), chroma.create("dropped")
    for cid in (kept, dropped):
        assert chroma.on(cid, "add", {"ids": ["a"], "embeddings": [[1.0, 2.0]]})[0] == 200
    locks = tmp_path / "locks" / "chroma"
    assert {p.name for p in locks.iterdir()} == {kept, dropped}
    assert chroma("DELETE", f"{DB}/collections/dropped")[0] == 200
    assert {p.name for p in locks.iterdir()} == {kept}
    assert chroma.on(kept, "add", {"ids": ["b"], "embeddings": [[2.0, 3.0]]})[0] == 200  # its lock works
    assert chroma("POST", "/reset")[0] == 200
    assert list(locks.iterdir()) == []
