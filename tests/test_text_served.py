"""Text in, served: an index built from real text (Debian's fortunes) by the build's own embedding
stage, served by real Serve over HTTP with its Embedder deployment, against the same model run in
this process. Exactness is bit for bit: a text search answers what a vector search of the text's
in-process embedding answers, ids and distances, single, batched and filtered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest

from loadtests.jaeger import Jaeger
from loadtests.served import wait_for
from shardserve.embed.model import Embedder
from shardserve.embed.text_data import real_texts
from tests.conftest import SERVE_PORT

CORPUS = 1000  # and half of the 400 queries are texts it holds
QUERIES = 400

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Fortunes a request may carry (at most 2,000 characters: the server's default limit)."""
    return [text for text in real_texts(CORPUS + QUERIES) if len(text) <= 2000][:CORPUS + QUERIES // 2]


@pytest.fixture(scope="module")
def jaeger() -> Iterator[Jaeger]:
    """A real trace store the served app exports to: Jaeger all-in-one (`make jaeger`)."""
    store = Jaeger().wait_ready()
    try:
        yield store
    finally:
        store.stop()


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory: pytest.TempPathFactory, texts: list[str],
           jaeger: Jaeger) -> Iterator[str]:
    """The corpus (JSON lines: a text and a `bucket` column to filter on) built into a 2-shard IVF
    index by `build --text-column --embedder`, served as its own app. Traced as a user turns it on
    (an endpoint, ratio 0): a request is traced when its caller's `traceparent` says sampled, so
    every other test here runs with tracing on and no request of theirs traced."""
    from deployments.run import deploy, undeploy
    from index_build.job import build_index

    root = tmp_path_factory.mktemp("text")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text, "bucket": i % 4}) + "\n"
                              for i, text in enumerate(texts[:CORPUS])))
    build_index(str(corpus), 2, "IVF16,Flat", str(root / "idx"), backend="local", text_column="text",
                embedder="all-MiniLM-L6-v2", metadata_columns=["bucket"])
    url = deploy(str(root / "idx"), port=SERVE_PORT, app_name="text", route_prefix="/text",
                 shard_num_cpus=0.1, router_num_cpus=0.1, embedder_num_cpus=0.1,
                 embedder_autoscaling=None, trace_endpoint=jaeger.otlp)
    try:
        yield url
    finally:
        undeploy("text")


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", content=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
                      headers={"content-type": "application/json"}, timeout=60)


def _answer(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_a_text_search_is_the_vector_search_of_its_embedding(served: str, embedder: Embedder,
                                                             texts: list[str]) -> None:
    """400 queries (half of them texts the index holds, half not): single by text and by the
    in-process vector, then in batches of 50, then filtered; ids and distances equal, bit for bit."""
    queries = texts[CORPUS - QUERIES // 2:]
    vectors = embedder.embed(queries)
    params = {"nprobe": 4}

    def both(i: int) -> tuple[dict, dict]:
        by_text = _answer(_post(served, "/v1/search", {"text": queries[i], "k": 10, "params": params}))
        by_vector = _answer(_post(served, "/v1/search", {"vector": vectors[i], "k": 10, "params": params}))
        return by_text, by_vector

    with ThreadPoolExecutor(8) as pool:
        pairs = list(pool.map(both, range(QUERIES)))
    for by_text, by_vector in pairs:
        assert (by_text["ids"], by_text["distances"]) == (by_vector["ids"], by_vector["distances"])
        assert len(by_text["ids"]) == 10 and by_text["embedding"]["model"] == "all-MiniLM-L6-v2"
    held = sum(pair[0]["ids"][0] == CORPUS - QUERIES // 2 + i for i, pair in enumerate(pairs[:QUERIES // 2]))
    assert held == QUERIES // 2  # a text the index holds finds itself first
    for where in (None, {"bucket": 1}):
        extra = {} if where is None else {"filter": where, "include": ["bucket"]}
        for start in range(0, QUERIES, 50):
            by_text = _answer(_post(served, "/v1/search", {"texts": queries[start:start + 50], "k": 10,
                                                           "params": params, **extra}))
            by_vector = _answer(_post(served, "/v1/search", {"vectors": vectors[start:start + 50],
                                                             "k": 10, "params": params, **extra}))
            assert [(r["ids"], r["distances"]) for r in by_text["results"]] == \
                [(r["ids"], r["distances"]) for r in by_vector["results"]]
            if where is not None:
                assert all(row == {"bucket": 1} for r in by_text["results"] for row in r["metadata"])


def test_embed_route_index_summary_and_bad_texts(served: str, embedder: Embedder, texts: list[str]) -> None:
    answer = _answer(_post(served, "/v1/embed", {"texts": texts[:20]}))
    got = np.asarray(answer["vectors"], np.float32)
    assert np.array_equal(got.view(np.uint32), embedder.embed(texts[:20]).view(np.uint32))
    assert answer["dim"] == embedder.dim
    assert answer["truncated"] == list(embedder.embed_batch(texts[:20]).truncated)  # fortunes past 256 tokens
    summary = _answer(httpx.get(f"{served}/v1/index", timeout=30))
    assert summary["embedder"] == embedder.identity.model_dump() and summary["metric"] == "cosine"
    assert summary["text"]["max_tokens"] == 256 and summary["text"]["max_texts"] == 64
    long = " ".join(texts[:40])[:1990]  # under the 2,000 characters, past the 256 tokens
    assert _answer(_post(served, "/v1/search", {"text": long, "k": 1}))["embedding"]["truncated"] == [0]
    for route, body, field in (("/v1/search", {"text": ""}, "text"),
                               ("/v1/search", {"texts": ["a", 1]}, "texts"),
                               ("/v1/search", {"text": "a", "vector": [0.0] * 384}, "text"),
                               ("/v1/search", {"texts": ["a"] * 65}, "texts"),
                               ("/v1/embed", {"texts": "a"}, "texts"),
                               ("/v1/upsert", {"ids": [1, 2], "texts": ["a"]}, "texts"),
                               # the other fields are checked before any model run
                               ("/v1/search", {"text": "fresh words", "k": 0}, "k"),
                               ("/v1/search", {"texts": ["fresh words"], "params": {"efSearch": 8}},
                                "params.efSearch"),
                               ("/v1/upsert", {"ids": [-1], "texts": ["fresh words"]}, "ids"),
                               ("/v1/upsert", {"ids": [1], "texts": ["a"], "metadata": [{"no": 1}]},
                                "metadata")):
        refused = _post(served, route, body)
        assert refused.status_code == 422 and refused.json()["field"] == field, (route, body, refused.text)
    # a text request that came by the edge's vector lane (its key escaped, past the edge's look)
    lane = httpx.post(f"{served}/v1/search", content=b'{"tex\\u0074": "a fool", "k": 1}',
                      headers={"x-shardserve-lane": "vector"}, timeout=30)
    assert lane.status_code == 422 and lane.json()["field"] == "text"


def test_text_upserts_are_visible_on_acknowledgement_and_deletes_stay_gone(served: str, embedder: Embedder,
                                                                          texts: list[str]) -> None:
    """Texts upserted are logged as the model's vectors: a vector search of the in-process embedding
    finds each at the same distance as a text search does."""
    new = ["The ship of state sails on a sea of paperwork.", "Every cat is a philosopher before breakfast."]
    ids = [900_001, 900_002]
    written = _answer(_post(served, "/v1/upsert", {"ids": ids, "texts": new,
                                                   "metadata": [{"bucket": 7}, None]}))
    assert written["upserted"] == 2
    vectors = embedder.embed(new)
    for text, vector, id_ in zip(new, vectors, ids, strict=True):
        by_text = _answer(_post(served, "/v1/search", {"text": text, "k": 3, "params": {"nprobe": 16}}))
        by_vector = _answer(_post(served, "/v1/search", {"vector": vector, "k": 3, "params": {"nprobe": 16}}))
        assert by_text["ids"][0] == id_ and (by_text["ids"], by_text["distances"]) == \
            (by_vector["ids"], by_vector["distances"])
    _answer(_post(served, "/v1/delete", {"ids": [ids[0]]}))
    after = _answer(_post(served, "/v1/search", {"text": new[0], "k": 3, "params": {"nprobe": 16}}))
    assert ids[0] not in after["ids"]


def _embedder_pid(app: str) -> int | None:
    """The embedder replica's process: Ray titles each replica's worker with its deployment."""
    import psutil

    title = f"ServeReplica:{app}:Embedder"
    for process in psutil.process_iter(["cmdline"]):
        if any(title in part for part in process.info["cmdline"] or ()):
            return process.pid
    return None


def test_text_upserts_survive_a_sigkill_of_the_embedder(served: str, embedder: Embedder) -> None:
    """Writers upsert batches of new texts while the embedder replica is SIGKILLed mid-request:
    every acknowledged batch is found whole (each text by its in-process vector, at distance 1), and
    a batch whose request failed left nothing (it was refused before the log append), until Serve
    has started a new embedder and writes are acknowledged again."""
    import os
    import signal
    import threading
    import time

    # 1,000 texts the index never held (past every one `texts` drew from), each one a request may carry
    fresh = [text for text in real_texts(CORPUS + QUERIES + 1000)[CORPUS + QUERIES:] if len(text) <= 2000]
    batches = [(list(range(800_000 + i, 800_000 + i + 8)), fresh[i:i + 8])
               for i in range(0, len(fresh) - 7, 8)]
    acked, failed, refused, lock, stop = [], [], [], threading.Lock(), threading.Event()
    taken = iter(range(len(batches)))

    def writer() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                with lock:
                    n = next(taken, None)
                if n is None:
                    return
                ids, texts = batches[n]
                try:
                    response = http.post(f"{served}/v1/upsert", json={"ids": ids, "texts": texts})
                    ok = response.status_code == 200
                    if 400 <= response.status_code < 500:
                        refused.append(response.text)  # a bad batch, not the kill
                except httpx.HTTPError:
                    ok = False
                with lock:
                    (acked if ok else failed).append(n)
                if not ok:
                    time.sleep(1.0)  # as Retry-After says, with the next batch (this one stays failed)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(acked) >= 5, "5 batches acknowledged", timeout_s=300)
        pid = _embedder_pid("text-index")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        acked_before = len(acked)
        # a new embedder answers: acknowledged writes again
        wait_for(lambda: len(acked) >= acked_before + 10, "10 more batches acknowledged after the kill",
                 timeout_s=300, interval_s=0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert not refused, refused[:3]
    assert failed, "the kill landed on no request: nothing was tested"

    def found(text_vector: np.ndarray, id_: int) -> bool:
        answer = _answer(_post(served, "/v1/search", {"vector": text_vector, "k": 10,
                                                      "params": {"nprobe": 16}}))
        return any(i == id_ and d > 0.9999 for i, d in zip(answer["ids"], answer["distances"], strict=True))

    for n in acked + failed:
        ids, texts = batches[n]
        present = [found(vector, id_) for vector, id_ in zip(embedder.embed(texts), ids, strict=True)]
        assert present == [n in acked] * len(ids), (n, present)


def test_the_dashboards_text_panels_query_exported_metrics(served: str, texts: list[str]) -> None:
    """After text traffic (searches, embeds, a burst past the text admission), every text
    metric configs/grafana/shardserve.json queries is exported by the node (Ray exports a counter
    only after its first increment, and application metrics every few seconds)."""
    import time

    from tests.test_grafana import _exported_metrics, _queried_metrics

    short = [text for text in texts if len(text) < 1000]

    async def burst() -> set[int]:  # more new texts at once than the text admission lets wait
        async with httpx.AsyncClient(timeout=60) as client:
            answers = await asyncio.gather(*[client.post(f"{served}/v1/embed", json={
                "texts": [f"burst {i}.{j}: {short[j]}" for j in range(60)]}) for i in range(8)])
        assert all(answer.status_code in (200, 503) for answer in answers), answers[0].text
        return {answer.status_code for answer in answers}

    assert asyncio.run(burst()) == {200, 503}
    wanted = _queried_metrics(text=True)
    assert {"ray_shardserve_embed_ms_bucket", "ray_shardserve_embed_cache_lookups_total",
            "ray_shardserve_embed_batch_texts_sum", "ray_shardserve_text_shed_requests_total"} <= wanted
    missing, n = wanted, 0

    def all_exported() -> bool:  # an embed, then a look once Ray has had time to export it
        nonlocal missing, n
        _answer(_post(served, "/v1/embed", {"texts": [f"{n}: {texts[n]}", texts[0]]}))
        n += 1
        time.sleep(2)
        missing = wanted - _exported_metrics()
        return not missing

    try:
        wait_for(all_exported, "every text metric the dashboard queries exported", timeout_s=90, interval_s=0)
    except AssertionError as exc:
        exc.add_note(f"text metrics the dashboard queries that nobody exported: {sorted(missing)}")
        raise


@pytest.mark.haproxy
def test_the_edge_gives_text_a_lane_of_its_own(served: str, embedder: Embedder, texts: list[str],
                                               tmp_path) -> None:
    """A burst of long texts at an edge with K_t = 2, Q_t = 2: at most 4 are taken, the rest get a
    503 at once from the edge; vector searches sent in the same burst all pass through the vector
    lane (its K slots are not the text lane's)."""
    from serving.edge import Admission, EdgeProcess
    from shardserve.runtime.ports import free_port

    port = free_port()
    edge = EdgeProcess(served.removesuffix("/text").removeprefix("http://"), f"127.0.0.1:{port}",
                       Admission(text_in_flight=2, text_queue=2), route_prefix="/text").start()
    long = [" ".join(texts[i:i + 30])[:1990] for i in range(20)]  # past the model's 256 tokens: slow
    vector = embedder.embed([texts[0]])[0]

    async def burst() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            base = f"http://127.0.0.1:{port}/text/v1/search"
            by_text = [client.post(base, json={"text": f"{i} {text}", "k": 3}) for i, text in enumerate(long)]
            by_vector = [client.post(base, content=orjson.dumps({"vector": vector, "k": 3},
                                                                option=orjson.OPT_SERIALIZE_NUMPY))
                         for _ in range(20)]
            answers = await asyncio.gather(*by_text, *by_vector)
        statuses = [answer.status_code for answer in answers]
        return statuses[:20], statuses[20:]

    try:
        text_statuses, vector_statuses = asyncio.run(burst())
    finally:
        edge.stop()
    assert vector_statuses == [200] * 20
    assert set(text_statuses) == {200, 503} and text_statuses.count(200) <= 4 + 2  # 4 taken, and
    # at most the few that found a slot freed while the burst was still arriving


def _spans(trace: dict) -> dict[str, list[dict]]:
    """Jaeger's spans of a trace by operation name, each with its service and parent span id."""
    by_name: dict[str, list[dict]] = {}
    for span in trace["spans"]:
        process = trace["processes"][span["processID"]]
        parents = [ref["spanID"] for ref in span["references"] if ref["refType"] == "CHILD_OF"]
        tags = {tag["key"]: tag["value"] for tag in process["tags"]}
        by_name.setdefault(span["operationName"], []).append(
            {**span, "service": process["serviceName"], "parent": parents[0] if parents else None,
             "replica": tags.get("shardserve.replica"), "shard": tags.get("shardserve.shard"),
             "end": span["startTime"] + span["duration"]})
    return by_name


def _inside(inner: dict, outer: dict) -> bool:
    """`inner` within `outer` in time (Jaeger keeps microseconds: one of slack at each end)."""
    return outer["startTime"] - 1 <= inner["startTime"] and inner["end"] <= outer["end"] + 1


def _traced_search(served: str, jaeger: Jaeger, body: dict, wanted: set[str], route: str = "/v1/search",
                   at_least: tuple[str, int] = ("faiss", 2)) -> tuple[dict, dict, str]:
    """A request (a search unless `route` says) sent as part of a caller's sampled trace: (its
    answer, its spans by name, the caller's span id), once Jaeger holds every span named in
    `wanted`, and `at_least` spans of one name (each shard's)."""
    import secrets

    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    response = httpx.post(f"{served}{route}", json=body, timeout=60,
                          headers={"traceparent": f"00-{trace_id}-{caller}-01"})
    answer = _answer(response)
    assert response.headers["traceresponse"].split("-")[1] == trace_id  # the answer names its trace

    def complete() -> dict[str, list[dict]] | None:
        trace = jaeger.trace(trace_id)
        spans = _spans(trace) if trace else {}
        name, count = at_least
        return spans if wanted <= set(spans) and len(spans.get(name, [])) >= count else None

    return answer, wait_for(complete, f"trace {trace_id} with spans {sorted(wanted)}", timeout_s=60,
                            interval_s=0.5), caller


def _a_traced_write_and_embed(served: str, jaeger: Jaeger, texts: list[str]) -> None:
    """A text upsert in a caller's trace: its parse, embedding (the embedder's span under it), log
    append (the group commit it rode in inside), answer, and each shard replica's apply of it, all
    under the write's span; a POST /v1/embed likewise, with its embedder's span."""
    router = {"upsert", "embed", "parse", "log append", "group commit", "answer"}
    body = {"ids": [900_101], "texts": [f"a traced write no cache holds: {texts[11]}"]}
    answer, spans, caller = _traced_search(served, jaeger, body, router | {"embedder", "model"},
                                           "/v1/upsert", ("apply", 2))
    (write,), (append,), (commit,), (embed,) = spans["upsert"], spans["log append"], spans["group commit"], \
        spans["embed"]
    assert write["parent"] == caller and write["service"] == "shardserve-router" and answer["upserted"] == 1
    for name in ("embed", "parse", "log append", "answer"):
        assert [span["parent"] for span in spans[name]] == [write["spanID"]], name
        assert _inside(spans[name][0], write), name
    assert commit["parent"] == append["spanID"] and _inside(commit, append)
    assert spans["embedder"][0]["parent"] == embed["spanID"]
    assert embed["end"] <= spans["parse"][0]["startTime"] + 1  # embedded, then parsed and logged
    applies = spans["apply"]
    assert {span["parent"] for span in applies} == {write["spanID"]}
    assert {span["service"] for span in applies} == {"shardserve-shard"}
    assert len({span["shard"] for span in applies}) == 2  # a replica of each shard applied it
    assert all(span["end"] >= commit["startTime"] for span in applies)  # it read the committed write

    answer, spans, caller = _traced_search(served, jaeger, {"texts": [f"an embedding, traced: {texts[12]}"]},
                                           {"embed request", "embed", "embedder", "model"}, "/v1/embed",
                                           ("embedder", 1))
    (request,), (embed,) = spans["embed request"], spans["embed"]
    assert request["parent"] == caller and embed["parent"] == request["spanID"]
    assert len(answer["vectors"]) == 1
    assert spans["embedder"][0]["parent"] == embed["spanID"] and _inside(embed, request)


def test_a_traced_search_is_one_trace_across_router_embedder_and_shards(served: str, jaeger: Jaeger,
                                                                          embedder: Embedder,
                                                                          texts: list[str]) -> None:
    """A vector search and a text search, each in a caller's sampled trace, read back from Jaeger:
    the router's spans under the caller's, the fan-out holding a span from a replica of each
    shard (its queue wait and FAISS time inside), the embedder's under the text's embed span; the
    spans' durations agree with the answer's timing_ms. A traced write and embedding likewise
    (`_a_traced_write_and_embed`). Then Jaeger is SIGKILLed: traced requests
    are still answered (the export is asynchronous and bounded)."""
    router = {"search", "parse", "batch wait", "fan-out", "merge", "answer"}
    shards = {"shard 0", "shard 1", "queue wait", "faiss"}
    vector = embedder.embed([texts[3]])[0].tolist()
    answer, spans, caller = _traced_search(served, jaeger, {"vector": vector, "k": 5}, router | shards)
    (search,), (fan,) = spans["search"], spans["fan-out"]
    assert search["parent"] == caller and search["service"] == "shardserve-router"
    for name in router - {"search"}:
        assert [span["parent"] for span in spans[name]] == [search["spanID"]], name
        assert _inside(spans[name][0], search), name
    for position in (0, 1):
        (shard,) = spans[f"shard {position}"]
        assert shard["parent"] == fan["spanID"] and shard["service"] == "shardserve-shard"
        assert _inside(shard, fan)  # every shard's part inside the fan-out
        for name in ("queue wait", "faiss"):
            (part,) = [span for span in spans[name] if span["parent"] == shard["spanID"]]
            assert _inside(part, shard)
    assert spans["shard 0"][0]["replica"] != spans["shard 1"][0]["replica"]
    # timing_ms: the search span holds the request's whole time, the fan-out holds the compute
    timing = answer["timing_ms"]
    assert search["duration"] >= timing["total"] * 1000 - 1
    assert fan["duration"] >= timing["compute"] * 1000 - 1
    assert max(span["duration"] for span in spans["faiss"]) <= fan["duration"]

    text = f"a text no cache holds: {texts[7]}"
    answer, spans, caller = _traced_search(served, jaeger, {"text": text, "k": 5},
                                           router | shards | {"embed", "embedder", "model"})
    (search,), (parse,), (embed,), (model,) = spans["search"], spans["parse"], spans["embed"], spans["model"]
    (remote,) = spans["embedder"]
    assert embed["parent"] == parse["spanID"] and remote["parent"] == embed["spanID"]
    assert remote["service"] == "shardserve-embedder" and model["parent"] == remote["spanID"]
    assert _inside(embed, parse) and _inside(remote, embed) and _inside(model, remote)
    assert search["duration"] >= answer["timing_ms"]["total"] * 1000 - 1

    _a_traced_write_and_embed(served, jaeger, texts)
    jaeger.kill()
    for i in range(20):
        response = httpx.post(f"{served}/v1/search", json={"vector": vector, "k": 5}, timeout=60,
                              headers={"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"})
        assert response.status_code == 200 and "traceresponse" in response.headers
