"""The text monolith `make bench-text` compares shardserve with (loadtests/text_monolith.py), on the
real packaged model and real text: its search core answers as brute force over the same vectors,
whether the shards merge into one flat or IVF index or are searched one by one; its LRU hands back the
model's vectors; its HTTP answers have shardserve's /v1/search shape and refusals."""

from __future__ import annotations

from collections.abc import Sequence

import faiss
import numpy as np
import pytest
from fastapi.testclient import TestClient

from loadtests.text_monolith import EachShard, TextSearcher, merge_indexes, text_app
from shardserve.embed.model import Embedder
from shardserve.embed.text_data import TextDataMissing, real_texts
from shardserve.index.indexes import make_empty_index
from shardserve.query.api import SearchResponse
from shardserve.query.searcher import ShardSearcher

MODEL = "all-MiniLM-L6-v2"
K = 10


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    """300 texts to index and 12 others to ask with (fortunes, else apt's package summaries)."""
    try:
        texts = [text for text in real_texts(400) if len(text) <= 300]
    except TextDataMissing as exc:
        pytest.skip(f"no real text on this machine: {exc}")
    return texts[:300], texts[300:312]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(MODEL, intra_op_threads=1)


@pytest.fixture(scope="module")
def base(embedder: Embedder, corpus: tuple[list[str], list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of the indexed texts: ids that are not row numbers."""
    return 1000 + 3 * np.arange(len(corpus[0]), dtype=np.int64), embedder.embed(corpus[0])


def _shards(factory: str, ids: np.ndarray, vectors: np.ndarray) -> list[faiss.Index]:
    """Two shards as a shardserve build makes them: copies of one trained empty index."""
    trained = make_empty_index(factory, vectors.shape[1], "cosine")
    trained.train(vectors)
    shards = []
    for part in (slice(0, 170), slice(170, None)):
        shard = faiss.clone_index(trained)
        shard.add_with_ids(vectors[part], ids[part])
        shards.append(shard)
    return shards


@pytest.mark.parametrize("layout", ["Flat merged", "IVF8,Flat merged", "Flat shard by shard"])
def test_text_search_answers_as_brute_force(layout: str, embedder: Embedder, corpus, base) -> None:
    indexed, asked = corpus
    ids, vectors = base
    factory, how = layout.split(" ", 1)
    shards = _shards(factory, ids, vectors)
    if how == "merged":
        merged = merge_indexes(shards, "cosine")
        assert merged is not None and merged.ntotal == len(ids)
        searcher = TextSearcher(ShardSearcher(merged, "cosine", "merged", "v"), embedder)
    else:
        searcher = TextSearcher(EachShard([ShardSearcher(s, "cosine", f"s{n}", "v")
                                           for n, s in enumerate(shards)]), embedder)
    params = {"nprobe": 8} if factory.startswith("IVF") else {}  # every list: exact
    queries = [*asked, indexed[7], indexed[250]]  # two indexed texts: each is its own nearest
    found_vectors, distances, found_ids, compute_ms = searcher.search(queries, K, params)

    alone = embedder.embed(queries)
    assert np.einsum("ij,ij->i", found_vectors, alone).min() >= 0.9999  # the model's vectors
    similarity = found_vectors @ vectors.T
    order = np.argsort(-similarity, axis=1, kind="stable")[:, :K]
    np.testing.assert_array_equal(found_ids, ids[order])
    np.testing.assert_allclose(distances, np.take_along_axis(similarity, order, axis=1), atol=1e-5)
    assert found_ids[-2, 0] == ids[7] and found_ids[-1, 0] == ids[250]
    assert distances[-2:, 0].min() > 0.999 and compute_ms > 0


class _Counting:
    """An embedder that counts the texts the model ran on."""

    def __init__(self, inner: Embedder):
        self.inner, self.texts = inner, 0

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.texts += len(texts)
        return self.inner.embed(texts)


def test_the_lru_hands_back_the_models_vectors_least_recent_out(embedder: Embedder, corpus, base) -> None:
    ids, vectors = base
    merged = merge_indexes(_shards("Flat", ids, vectors), "cosine")
    counting = _Counting(embedder)
    searcher = TextSearcher(ShardSearcher(merged, "cosine", "merged", "v"), counting, cache_entries=2)
    a, b, c = corpus[1][:3]
    first = searcher.embed([a, b, a])
    assert counting.texts == 2  # a repeat inside a batch runs once
    again = searcher.embed([b, a])
    assert counting.texts == 2 and np.array_equal(again, first[[1, 0]])  # hits: the same bits
    searcher.embed([c])  # a full LRU of 2 drops the least recently used: b
    searcher.embed([a])
    assert counting.texts == 3
    searcher.embed([b])
    assert counting.texts == 4
    assert searcher.cache is not None and len(searcher.cache) == 2
    assert TextSearcher(searcher.searcher, embedder).cache is None  # no cache unless asked


def test_http_answers_have_the_search_shape_and_refusals_name_the_field(embedder: Embedder, corpus,
                                                                        base) -> None:
    ids, vectors = base
    merged = merge_indexes(_shards("Flat", ids, vectors), "cosine")
    searcher = TextSearcher(ShardSearcher(merged, "cosine", "merged", "v"), embedder)
    client = TestClient(text_app(searcher, "v-test", frozenset()))
    assert client.get("/v1/health").json() == {"status": "ok"}

    text = corpus[0][42]
    one = client.post("/v1/search", json={"text": text, "k": 5})
    assert one.status_code == 200
    answer = SearchResponse.model_validate(one.json())
    assert answer.ids is not None and answer.distances is not None and len(answer.ids) == 5
    assert answer.ids[0] == ids[42] and answer.index == "v-test"
    assert answer.coverage.answered == answer.coverage.shards == 1
    assert answer.timing_ms.total >= answer.timing_ms.compute > 0
    _, _, expected, _ = searcher.search([text], 5)
    assert answer.ids == expected[0].tolist()

    batch = client.post("/v1/search", json={"texts": [text, corpus[1][0]], "k": 3})
    results = SearchResponse.model_validate(batch.json()).results
    assert batch.status_code == 200 and results is not None and [len(r.ids) for r in results] == [3, 3]
    assert results[0].ids == answer.ids[:3]

    for body, field in (({"text": text, "texts": [text]}, "text"), ({"k": 3}, "text"),
                        ({"text": "  "}, "text"), ({"texts": []}, "texts"), ({"text": text, "k": 0}, "k"),
                        ({"text": text, "params": {"nprobe": 4}}, "params.nprobe"),
                        ({"text": text, "filter": {"label": 3}}, "filter"),
                        ({"text": text, "vector": [0.0]}, "vector")):
        refused = client.post("/v1/search", json=body)
        assert refused.status_code == 422 and refused.json()["field"] == field, body
    assert client.post("/v1/search", content=b"{not json").json()["field"] == "body"


# --- make bench-text's own parts (loadtests/bench_text.py) ---------------------------------------

def test_bench_text_levels_send_each_text_once_and_zipf_repeats_few() -> None:
    from loadtests.bench_text import query_sets

    pool = [f"fortune number {n} of the pool" for n in range(3000)]
    sets = query_sets(pool, per_level=4000, warm=500, zipf_texts=1000, exponent=1.1)
    unique = sets.warm + sets.wide + sets.one
    assert (len(sets.warm), len(sets.wide), len(sets.one)) == (500, 4000, 4000)
    assert len(set(unique)) == len(unique)  # no text twice, across the warm-up and both levels
    assert not set(unique) & set(sets.zipf) and set(sets.zipf) <= set(pool[-1000:])
    counts = sorted((sets.zipf.count(t) for t in set(sets.zipf)), reverse=True)
    assert len(sets.zipf) == 4000 and counts[0] > 10 * counts[len(counts) // 2]  # a head and a long tail
    assert query_sets(pool, 4000, 500, 1000, 1.1).zipf == sets.zipf  # a fixed seed


def test_bench_text_ratios_pool_the_rounds_of_each_side() -> None:
    from loadtests.bench_text import checks, per_round, ratios, summarize_sides

    def level(label: str, clients: int, qps: float, cpu: float, p50: float) -> dict:
        return {"label": label, "value": clients, "qps": qps, "requests": int(qps * 10), "p50_ms": p50,
                "p99_ms": 2 * p50, "success_ratio": 1.0, "status_codes": {"200": int(qps * 10)},
                "cpu_ms_per_request": {"total (servers)": cpu}}

    levels = []
    for n, (mine, theirs) in enumerate(((150.0, 120.0), (130.0, 130.0))):
        levels += [level(f"monolith-unique-{n}", 32, theirs, 16.0, 250.0),
                   level(f"monolith-unique-{n}", 1, 60.0, 17.0, 12.0),
                   level(f"shardserve-unique-{n}", 32, mine, 12.0, 200.0),
                   level(f"shardserve-unique-{n}", 1, 55.0, 18.0, 12.5),
                   level(f"shardserve-zipf-{n}", 32, 600.0, 3.0, 50.0),
                   level(f"shardserve-nocache-zipf-{n}", 32, 150.0, 12.0, 200.0),
                   level(f"monolith-lru4096-zipf-{n}", 32, 280.0, 6.0, 100.0)]
    summary = summarize_sides(levels)
    measured = ratios(summary)
    assert summary["shardserve"]["unique_c32"]["qps"] == 140.0
    assert measured["qps_unique_c32_vs_monolith"] == 1.12  # 140 over 125: the means of the rounds
    assert measured["cpu_per_request_unique_c32_vs_monolith"] == 0.75
    assert measured["c1_p50_minus_monolith_c1_p50_ms"] == 0.5
    assert measured["zipf_qps_cache_vs_no_cache"] == 4.0
    met = {name: check["met"] for name, check in checks(measured).items()}
    assert met == {"qps_unique_c32_vs_monolith": False, "cpu_per_request_unique_c32_vs_monolith": True,
                   "c1_p50_minus_monolith_c1_p50_ms": True, "zipf_qps_cache_vs_no_cache": True}
    assert [r["qps_unique_c32_vs_monolith"] for r in per_round(levels)] == [1.25, 1.0]
    monolith_only = [lv for lv in levels if lv["label"].startswith("monolith")]
    assert all(c["met"] is None for c in checks(ratios(summarize_sides(monolith_only))).values())
