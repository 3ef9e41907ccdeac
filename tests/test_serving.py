"""Real Ray Serve over HTTP on loopback: recall, single vs batch, every error, concurrency, health."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from index_build.job import build_index
from loadtests.served import wait_for
from serving.evaluate import evaluate
from shardserve.data.datasets import load_dataset
from shardserve.query.parse import npy_body
from shardserve.query.searcher import load_all_shards
from tests.conftest import SERVE_PORT as PORT
from tests.conftest import run_cli
from tests.faults import slow_shards

pytestmark = pytest.mark.slow
URL = f"http://127.0.0.1:{PORT}"
FRONT_PORT = 18322  # the router replica's own HTTP door (shardserve.transport.http_front), beside Serve's
DOORS = {"serve": PORT, "front": FRONT_PORT}
LIMIT = "20000"


@pytest.fixture(scope="module")
def fm_index(ray_cluster, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "fm"
    build_index("fashion-mnist", 4, "IVF256,Flat", str(out), limit=int(LIMIT), backend="ray")
    return out


@pytest.fixture(scope="module")
def served(fm_index: Path):
    from deployments.run import deploy, undeploy

    url = deploy(str(fm_index), port=PORT, max_vectors=256, front_port=FRONT_PORT)
    assert url == URL
    yield URL
    undeploy()


@pytest.fixture(params=sorted(DOORS))
def door(request, served) -> str:
    """Both ways in: Serve's HTTP path and the router's front door answer every route the same."""
    return f"http://127.0.0.1:{DOORS[request.param]}"


@pytest.fixture(scope="module")
def queries() -> np.ndarray:
    return load_dataset("fashion-mnist", num_queries=200).queries


def _post(payload: dict | bytes, url: str = URL, **kwargs) -> httpx.Response:
    content = (payload if isinstance(payload, bytes)
               else orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY))
    return httpx.post(f"{url}/v1/search", content=content,
                      headers={"content-type": "application/json"}, timeout=30, **kwargs)


def test_recall_over_http_equals_in_process(door: str, fm_index: Path) -> None:
    result = run_cli("eval", str(fm_index), "--dataset", "fashion-mnist", "--limit", LIMIT,
                     "--nprobe", "16", "--url", door, "--json")
    assert result.returncode == 0, result.stderr
    over_http = json.loads(result.stdout)
    in_process = evaluate(str(fm_index), "fashion-mnist", k=10, params={"nprobe": 16}, limit=int(LIMIT))
    assert over_http["recall"] >= 0.97
    assert abs(over_http["recall"] - in_process["recall"]) <= 0.005


def test_single_and_batch_agree_with_in_process(door: str, fm_index: Path, queries: np.ndarray) -> None:
    from serving.evaluate import sharded_search

    manifest, searchers = load_all_shards(str(fm_index))
    distances, ids = sharded_search(searchers, queries[:20], 7, {"nprobe": 8}, manifest.metric)
    batch = _post({"vectors": queries[:20], "k": 7, "params": {"nprobe": 8}}, door)
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert body["coverage"] == {"shards": 4, "answered": 4}
    assert body["index"] == manifest.index_version
    assert {"total", "compute", "queue"} <= set(body["timing_ms"])
    for row, hits in enumerate(body["results"]):
        assert hits["ids"] == ids[row].tolist()
        np.testing.assert_allclose(hits["distances"], distances[row], rtol=1e-6)
        single = _post({"vector": queries[row], "k": 7, "params": {"nprobe": 8}}, door).json()
        assert single["ids"] == hits["ids"]


def test_the_python_client_answers_as_the_router_does(door: str, fm_index: Path, queries: np.ndarray) -> None:
    """shardserve.Client and AsyncClient (real HTTP): ids and distances equal the in-process search;
    a refused request raises ApiError with the status, message and field the server gave."""
    import asyncio

    from serving.evaluate import sharded_search
    from shardserve import ApiError, AsyncClient, Client

    manifest, searchers = load_all_shards(str(fm_index))
    distances, ids = sharded_search(searchers, queries[:5], 6, {"nprobe": 8}, manifest.metric)
    with Client(door) as client:
        single = client.search(queries[0], k=6, params={"nprobe": 8})
        batch = client.search_batch(queries[:5], k=6, params={"nprobe": 8})
        assert client.health()["status"] == "ok" and client.index()["num_vectors"] == manifest.num_vectors
        with pytest.raises(ApiError) as refused:
            client.search(queries[0][:10], k=6)
    assert single.ids.tolist() == ids[0].tolist() and single.extra["coverage"]["answered"] == 4
    assert [hits.ids.tolist() for hits in batch] == ids.tolist()
    np.testing.assert_allclose(np.stack([hits.distances for hits in batch]), distances, rtol=1e-6)
    assert refused.value.status == 422 and refused.value.field == "vector"

    async def concurrently() -> list:
        async with AsyncClient(door) as client:
            return await asyncio.gather(*[client.search(q, k=6, params={"nprobe": 8}) for q in queries[:5]])

    assert [hits.ids.tolist() for hits in asyncio.run(concurrently())] == ids.tolist()


def test_a_filter_is_pushed_into_every_shard_and_graded_exactly(door: str, queries: np.ndarray) -> None:
    """Fashion-MNIST's own labels over HTTP: one class (10 %) and a class within an id range (~1 %):
    every hit matches, `matched` counts the matching rows, recall@10 against brute force over the
    matching rows >= 0.95; a bad filter is a 422 naming `filter`, and the next query is answered."""
    data = load_dataset("fashion-mnist", limit=int(LIMIT))
    labels = data.metadata.column("label").to_numpy()
    first_rows = np.arange(len(labels)) < 2000
    for where, allowed in (({"label": 3}, labels == 3),
                           ({"label": 3, "$id": {"$lt": 2000}}, (labels == 3) & first_rows)):
        rows = np.flatnonzero(allowed)
        answer = _post({"vectors": queries[:30], "k": 10, "params": {"nprobe": 8}, "filter": where,
                        "include": ["label"]}, door)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["matched"] == len(rows)
        exact = ((queries[:30, None, :] - data.base[rows][None, :, :]) ** 2).sum(axis=2)
        truth = rows[np.argsort(exact, axis=1, kind="stable")[:, :10]]
        recall = np.mean([len(set(hits["ids"]) & set(t)) / 10
                          for hits, t in zip(body["results"], truth.tolist(), strict=True)])
        assert recall >= 0.95, (where, recall)
        assert all(row["label"] == 3 for hits in body["results"] for row in hits["metadata"])
    three = _post({"vector": queries[0], "k": 10, "filter": {"$id": {"$in": [5, 77, 1234]}}}, door).json()
    assert sorted(three["ids"]) == [5, 77, 1234] and three["matched"] == 3  # k=10, 3 rows match: those 3
    bad = _post({"vector": queries[0], "k": 5, "filter": {"lable": 3}}, door)
    assert bad.status_code == 422 and bad.json()["field"] == "filter" and "lable" in bad.json()["error"]
    assert _post({"vector": queries[0], "k": 5}, door).status_code == 200
    # 20,000 comparisons: refused by the router (a 422, not every shard busy, then a 503)
    leaves = [{"label": i % 10} for i in range(20_000)]
    huge = _post({"vector": queries[0], "k": 5, "filter": {"$or": leaves}}, door)
    assert huge.status_code == 422 and huge.json()["field"] == "filter"
    assert "comparisons" in huge.json()["error"]
    assert _post({"vector": queries[0], "k": 5}, door).status_code == 200


def test_npy_bodies_answer_as_json_does(door: str, queries: np.ndarray) -> None:
    """The binary request format (shardserve.query.api.parse_npy_request) over both doors: the same answers as
    JSON, its options in the query string, its errors 4xx naming the field."""
    batch = queries[:16].astype(np.float32)
    want = _post({"vectors": batch, "k": 5, "params": {"nprobe": 8}}, door).json()
    npy = {"content-type": "application/x-npy"}
    got = httpx.post(f"{door}/v1/search?k=5&nprobe=8", content=npy_body(batch), headers=npy, timeout=30)
    assert got.status_code == 200, got.text
    assert [r["ids"] for r in got.json()["results"]] == [r["ids"] for r in want["results"]]
    one = httpx.post(f"{door}/v1/search?k=5&nprobe=8", content=npy_body(batch[0]), headers=npy, timeout=30)
    assert one.json()["ids"] == want["results"][0]["ids"]
    for query, body, field in (("k=5", npy_body(batch[:, :100]), "vectors"), ("k=500", npy_body(batch), "k"),
                               ("efSearch=4", npy_body(batch), "params.efSearch"), ("", b"junk", "body")):
        refused = httpx.post(f"{door}/v1/search?{query}", content=body, headers=npy, timeout=30)
        assert refused.status_code == 422 and refused.json()["field"] == field, refused.text


@pytest.mark.parametrize("payload, status, field", [
    ({"vector": [0.0] * 3}, 422, "vector"),
    ({"vector": [0.0] * 784, "k": 0}, 422, "k"),
    ({"vector": [0.0] * 784, "k": 101}, 422, "k"),
    ({"vectors": []}, 422, "vectors"),
    ({"vectors": [[0.0] * 784] * 257}, 422, "vectors"),
    ({"vector": [0.0] * 784, "params": {"efSearch": 5}}, 422, "params.efSearch"),
    ({"vector": [0.0] * 784, "params": {"bogus": 5}}, 422, "params.bogus"),
    (b'{"vector": [NaN' + b', 0.0' * 783 + b"]}", 422, "vector"),
    (b"not json", 422, "body"),
])
def test_bad_requests_get_4xx_naming_the_field(door: str, payload, status: int, field: str) -> None:
    response = _post(payload, door)
    assert response.status_code == status, response.text
    assert response.json()["field"] == field and response.json()["error"]


def test_oversized_body_is_413(door: str) -> None:
    response = _post(b"[" + b"0.0," * 5_000_000 + b"0.0]", door)
    assert response.status_code == 413


def _router_rss_bytes() -> int:
    from shardserve.runtime.procfs import pids_matching

    [pid] = pids_matching(b"ray::ServeReplica:shardserve:Router")
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def _read_response(conn) -> bytes:
    """One whole HTTP response (headers + Content-Length body): a single recv may return the headers
    alone, the body arriving in a later segment."""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _response_length(data):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _response_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return len(head) + 4 + length


def test_chunked_body_is_cut_off_at_the_limit_not_buffered(door: str) -> None:
    """No Content-Length: the router counts while reading and answers 413 at 16 MB of a 256 MB
    upload (one `vector` of ~64M numbers), before any of it is parsed; its memory does not grow by
    the body's size."""
    import select
    import socket

    chunk = b"0.0," * 262_144  # 1 MiB of numbers
    before = _router_rss_bytes()
    sent = 0
    with socket.create_connection(("127.0.0.1", int(door.rsplit(":", 1)[1])), timeout=30) as conn:
        conn.sendall(b"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        framed = b"%x\r\n" % (len(chunk) + 12) + b'{"vector": [' + chunk + b"\r\n"
        for _ in range(256):
            if select.select([conn], [], [], 0)[0]:
                break  # the answer came before the upload ended
            try:
                conn.sendall(framed)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(framed)
            framed = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
        answer = _read_response(conn)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"exceeds 16777216 bytes" in answer
    assert sent < 64 * 2**20, sent  # stopped near the limit (socket and proxy buffers aside)
    assert _router_rss_bytes() - before < 64 * 2**20


def test_health_index_and_docs(door: str, fm_index: Path) -> None:
    health = httpx.get(f"{door}/v1/health", timeout=10)
    assert health.status_code == 200 and health.json()["shards"] == 4
    # shard replicas announce their links; the router follows: every shard is reached over its link
    wait_for(lambda: httpx.get(f"{door}/v1/health", timeout=10).json()["links"] == [1, 1, 1, 1],
             "every shard reached over its link", timeout_s=15, interval_s=0.5)
    info = httpx.get(f"{door}/v1/index", timeout=10).json()
    assert info["num_vectors"] == int(LIMIT) and info["params"] == ["nprobe"]
    assert [s["name"] for s in info["shards"]] == ["shard-000", "shard-001", "shard-002", "shard-003"]
    assert httpx.get(f"{door}/docs", timeout=10).status_code == 200
    assert "/v1/search" in httpx.get(f"{door}/openapi.json", timeout=10).json()["paths"]
    missing = httpx.get(f"{door}/v2/nothing", timeout=10)
    assert missing.status_code == 404 and "no route GET /v2/nothing" in missing.json()["error"]


def test_concurrent_mixed_params_get_their_own_answers(door: str, fm_index: Path,
                                                       queries: np.ndarray) -> None:
    """Requests with different k / nprobe batched together each get exactly their in-process answer."""
    from serving.evaluate import sharded_search

    manifest, searchers = load_all_shards(str(fm_index))
    cases = [(row, k, nprobe) for row in range(40) for k, nprobe in ((3, 1), (10, 16))]
    expected = {(row, k, nprobe): sharded_search(searchers, queries[row:row + 1], k, {"nprobe": nprobe},
                                                 manifest.metric)[1][0].tolist()
                for row, k, nprobe in cases}

    async def fire() -> list[tuple[tuple, httpx.Response]]:
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(case):
                row, k, nprobe = case
                body = orjson.dumps({"vector": queries[row], "k": k, "params": {"nprobe": nprobe}},
                                    option=orjson.OPT_SERIALIZE_NUMPY)
                return case, await client.post(f"{door}/v1/search", content=body)
            bad = [client.post(f"{door}/v1/search", content=b'{"vector": [1]}') for _ in range(10)]
            results = await asyncio.gather(*[one(c) for c in cases], *bad)
            return [r for r in results if isinstance(r, tuple)]

    answers = asyncio.run(fire())
    assert len(answers) == len(cases)
    batched = 0
    for case, response in answers:
        assert response.status_code == 200, response.text
        assert response.json()["ids"] == expected[case]
        batched += response.json()["batch"] > 1
    assert batched > 0, "no two in-flight requests were batched"


def test_slow_shard_gives_partial_answer_or_503_with_require_full(served, fm_index: Path,
                                                                 queries: np.ndarray) -> None:
    """A shard slower than the deadline is left out (coverage says so); require_full turns it into 503."""
    from deployments.run import deploy, undeploy

    url = deploy(str(fm_index), port=PORT, app_name="slow", route_prefix="/slow",
                 shard_timeout_s=0.3, shard_class=slow_shards(search_s={"shard-002": 1.0}),
                 shard_num_cpus=0.1, router_num_cpus=0.1)
    try:
        partial = httpx.post(f"{url}/v1/search", content=orjson.dumps(
            {"vector": queries[0], "k": 5}, option=orjson.OPT_SERIALIZE_NUMPY), timeout=10)
        assert partial.status_code == 200, partial.text
        assert partial.json()["coverage"] == {"shards": 4, "answered": 3}  # it did not wait for shard-002
        full = httpx.post(f"{url}/v1/search", content=orjson.dumps(
            {"vector": queries[0], "k": 5, "require_full": True}, option=orjson.OPT_SERIALIZE_NUMPY),
            timeout=10)
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert full.json()["field"] == "require_full"
    finally:
        undeploy("slow")


def test_health_is_503_until_every_shard_is_loaded(served, fm_index: Path, tmp_path: Path) -> None:
    from deployments.run import deploy, undeploy

    # shard-001 loads only once the test has seen a 503 and says so (a file): the order, not a time
    go = tmp_path / "load-shard-001"
    deploy(str(fm_index), port=PORT, app_name="late", route_prefix="/late", wait=False,
           shard_class=slow_shards(load_after={"shard-001": str(go)}), shard_num_cpus=0.1,
           router_num_cpus=0.1)
    statuses: list[int] = []

    def healthy() -> bool:  # every status seen on the way, kept
        try:
            statuses.append(httpx.get(f"{URL}/late/v1/health", timeout=10).status_code)
        except httpx.HTTPError:
            statuses.append(0)
        return statuses[-1] == 200

    try:
        wait_for(lambda: healthy() or 503 in statuses, "a 503 while shard-001 has not loaded", timeout_s=300,
                 interval_s=0.25)
        go.touch()
        wait_for(healthy, "health 200 once every shard is loaded", timeout_s=120, interval_s=0.25)
        assert 503 in statuses, statuses
        assert all(s != 200 for s in statuses[:-1])
        # the main app kept serving meanwhile
        assert httpx.get(f"{URL}/v1/health", timeout=10).status_code == 200
    finally:
        undeploy("late")


def test_overload_is_shed_with_fast_503(served, fm_index: Path, queries: np.ndarray) -> None:
    """Admission control: beyond max_in_flight a request gets 503 + Retry-After at once, not a queue."""

    from deployments.run import deploy, undeploy

    serve_url = deploy(str(fm_index), port=PORT, app_name="tight", route_prefix="/tight", max_in_flight=4,
                       body_timeout_s=1.5, shard_class=slow_shards(search_s={"shard-000": 0.5}),
                       shard_num_cpus=0.1, router_num_cpus=0.1, front_port=FRONT_PORT + 1)
    body = orjson.dumps({"vector": queries[0], "k": 5}, option=orjson.OPT_SERIALIZE_NUMPY)

    async def burst() -> list[tuple[int, str | None]]:
        """24 at once; (status, Retry-After) in the order the answers completed."""
        done: list[tuple[int, str | None]] = []
        async with httpx.AsyncClient(timeout=30) as client:
            async def one() -> None:
                response = await client.post(f"{url}/v1/search", content=body)
                done.append((response.status_code, response.headers.get("retry-after")))
            await asyncio.gather(*[one() for _ in range(24)])
        return done

    async def slow_uploads_then_normal_requests() -> tuple[list[int], list[int]]:
        """8 uploads that stall past body_timeout_s, and meanwhile 2 normal requests: with
        max_in_flight=4 the normal ones get 200 only if uploads hold no admission slot."""
        async with httpx.AsyncClient(timeout=30) as client:
            async def stalled() -> int:
                async def parts():
                    yield body[:100]
                    await asyncio.sleep(3.0)
                    yield body[100:]
                try:
                    return (await client.post(f"{url}/v1/search", content=parts())).status_code
                except httpx.TransportError:
                    return 0  # the router gave up on the upload and closed the connection
            uploads = [asyncio.ensure_future(stalled()) for _ in range(8)]
            await asyncio.sleep(0.5)
            normal = await asyncio.gather(*[client.post(f"{url}/v1/search", content=body)
                                            for _ in range(2)])
            return [r.status_code for r in normal], await asyncio.gather(*uploads)

    try:
        for url in (serve_url, f"http://127.0.0.1:{FRONT_PORT + 1}"):  # both doors shed alike
            normal, uploads = asyncio.run(slow_uploads_then_normal_requests())
            assert normal == [200, 200], (url, normal)
            assert set(uploads) <= {408, 0} and 408 in uploads, (url, uploads)
            outcomes = asyncio.run(burst())
            statuses = [status for status, _ in outcomes]
            assert set(statuses) <= {200, 503}, (url, statuses)
            assert statuses.count(200) >= 4 and statuses.count(503) >= 8, (url, statuses)
            assert all(retry == "1" for status, retry in outcomes if status == 503)
            # the first answers were 503s: shed before the slow shard could answer anything
            assert statuses[:8] == [503] * 8, (url, statuses)
    finally:
        undeploy("tight")
