"""The router's text front in plain Python: text bodies, the upsert body the log takes, and the text
admission. The embedder here is a coroutine over the real model (or one that waits, to hold texts
in flight); tests/test_text_served.py runs the same through Serve over HTTP."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from shardserve.embed.front import (
    TextFront,
    embed_request,
    needs_embedder,
    text_search,
    text_upsert,
    upsert_body,
)
from shardserve.embed.model import Embedder
from shardserve.embed.text_data import real_texts
from shardserve.embed.validate import check_text
from shardserve.index.manifest import BuildInfo, DatasetInfo, Manifest, ShardEntry
from shardserve.query.api import ApiError
from shardserve.writes.parse import parse_upsert


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return real_texts(64)


def _manifest(embedder: Embedder | None) -> Manifest:
    dim = embedder.dim if embedder is not None else 8
    shard = ShardEntry(name="shard-000", path="shard-000.faiss", sha256="0" * 64, bytes=1, num_vectors=1)
    return Manifest(index_version="v", dim=dim, metric="cosine", index_factory="Flat", num_vectors=1,
                    shards=[shard], dataset=DatasetInfo(name="t", fingerprint="f"),
                    build=BuildInfo(params={}, seconds=0, ray_version="x", faiss_version="x"),
                    created_at="now", embedder=None if embedder is None else embedder.identity)


def test_text_search_bodies() -> None:
    assert text_search(b'{"vector": [1, 2], "k": 3}') is None
    assert text_search(b'{"vector": [1, 2], "filter": {"context": "x"}}') is None  # a field named text-ish
    payload, asked, single = text_search(b'{"text": "a fool", "k": 3}')  # type: ignore[misc]
    assert (asked, single, payload) == (["a fool"], True, {"k": 3})
    payload, asked, single = text_search(b'{"texts": ["a", "b"], "k": 3}')  # type: ignore[misc]
    assert (asked, single) == (["a", "b"], False)
    for body, field, words in ((b'{"text": "a", "vector": [1]}', "text", "not both"),
                               (b'{"text": "a", "texts": ["b"]}', "text", "exactly one"),
                               (b'{"text": "   "}', "text", "empty"),
                               (b'{"text": 3}', "text", "string"),
                               (b'{"texts": []}', "texts", "non-empty"),
                               (b'{"texts": ["a", null]}', "texts", "texts[1]"),
                               (b'{"text": "' + b"x" * 2001 + b'"}', "text", "2001 characters")):
        with pytest.raises(ApiError) as error:
            text_search(body)
        assert (error.value.status, error.value.field) == (422, field) and words in error.value.message
    with pytest.raises(ApiError, match="too many texts"):
        text_search(orjson.dumps({"texts": ["a"] * 5}), max_texts=4)
    with pytest.raises(ApiError, match="characters together"):
        text_search(orjson.dumps({"texts": ["x" * 2000] * 17}))  # 34,000 > 32,000 in one request
    with pytest.raises(ApiError, match="lone surrogate"):
        check_text("a \ud800 b")  # json.loads writes one from "\\ud800"; UTF-8 cannot hold it


def test_embed_and_upsert_bodies() -> None:
    assert embed_request(b'{"texts": ["a"]}') == ["a"]
    with pytest.raises(ApiError, match="unknown field"):
        embed_request(b'{"texts": ["a"], "k": 1}')
    assert text_upsert(b'{"ids": [1], "vectors": [[1.0]]}', 10) is None
    assert text_upsert(b'{"ids": [1], "texts": ["a"]}', 10) == ({"ids": [1]}, ["a"])
    for body, words in ((b'{"ids": [1, 2], "texts": ["a"]}', "aligned"),
                        (b'{"ids": [1], "texts": ["a"], "vectors": [[1]]}', "not both")):
        with pytest.raises(ApiError) as error:
            text_upsert(body, 10)
        assert error.value.field == "texts" and words in error.value.message
    with pytest.raises(ApiError, match="too many texts"):
        text_upsert(orjson.dumps({"ids": [1, 2], "texts": ["a", "b"]}), 1)


def test_upserted_vectors_are_the_models_bits(embedder: Embedder, texts: list[str]) -> None:
    """The body the log takes holds the model's float32 vectors exactly (orjson's shortest float32
    decimals read back to the same bits), so a text upsert stores what a vector upsert of the
    in-process embedding stores."""
    vectors = embedder.embed(texts)
    body = upsert_body({"ids": list(range(len(texts)))}, vectors)
    logged = parse_upsert(body, embedder.dim, "cosine", {}, 1000)
    direct = parse_upsert(orjson.dumps({"ids": list(range(len(texts))), "vectors": vectors},
                                       option=orjson.OPT_SERIALIZE_NUMPY), embedder.dim, "cosine", {}, 1000)
    assert np.array_equal(np.array(orjson.loads(body)["vectors"], np.float32).view(np.uint32),
                          vectors.view(np.uint32))
    assert all(np.array_equal(a.vector, b.vector) for a, b in zip(logged, direct, strict=True))


def test_an_index_of_vectors_refuses_text_naming_the_field() -> None:
    with pytest.raises(ApiError) as error:
        needs_embedder(_manifest(None), "texts")
    assert (error.value.status, error.value.field) == (422, "texts")
    assert "without an embedder" in error.value.message


def test_front_embeds_misses_once_and_answers_hits_from_the_cache(embedder: Embedder,
                                                                  texts: list[str]) -> None:
    manifest, calls = _manifest(embedder), []

    async def call(missing: list[str]) -> tuple[np.ndarray, tuple[int, ...]]:
        calls.append(list(missing))
        embedded = embedder.embed_batch(missing)
        return embedded.vectors, embedded.truncated

    async def run() -> None:
        front = TextFront(16 << 20, 64, 30.0, 1)
        asked = [texts[0], texts[1], texts[0]]
        first = await front.embed(manifest, asked, call)
        assert calls == [[texts[0], texts[1]]] and first.cached == 0
        assert np.array_equal(first.vectors, embedder.embed(asked))
        again = await front.embed(manifest, [texts[1], texts[2]], call)
        assert calls[-1] == [texts[2]] and again.cached == 1
        assert np.array_equal(again.vectors, embedder.embed([texts[1], texts[2]]))
        long = " ".join(texts) * 2  # past the model's 256 tokens
        cut = await front.embed(manifest, [texts[3], long], call)
        assert cut.truncated == (1,)
        assert (await front.embed(manifest, [long, texts[3]], call)).truncated == (0,)  # from the cache

    asyncio.run(run())


def test_text_admission_refuses_at_once_past_its_bound_but_never_a_hit(embedder: Embedder,
                                                                       texts: list[str]) -> None:
    """Texts waiting for the embedder are bounded: a request whose misses would pass the bound is a
    503 before any model work; one answered from the cache is not counted, nor refused."""
    manifest = _manifest(embedder)

    async def run() -> None:
        gate = asyncio.Event()

        async def slow(missing: list[str]) -> tuple[np.ndarray, tuple[int, ...]]:
            await gate.wait()
            return embedder.embed(missing), ()

        front = TextFront(16 << 20, 4, 30.0, 2)
        gate.set()
        alone = await front.embed(manifest, texts[10:16], slow)  # 6 > 4, but nothing else waits
        assert len(alone.vectors) == 6 and front.shed == 0
        gate.clear()
        gate.set()
        await front.embed(manifest, [texts[0]], slow)  # in the cache from now on
        gate.clear()
        held = asyncio.create_task(front.embed(manifest, texts[1:4], slow))
        await asyncio.sleep(0.01)
        assert front.in_flight == 3
        with pytest.raises(ApiError) as error:
            await front.embed(manifest, texts[4:6], slow)
        assert (error.value.status, error.value.retry_after) == (503, 2) and front.shed == 1
        hit = await front.embed(manifest, [texts[0]], slow)  # waits for nothing
        assert hit.cached == 1
        fits = asyncio.create_task(front.embed(manifest, [texts[6]], slow))  # 3 + 1 <= 4
        await asyncio.sleep(0.01)
        assert front.in_flight == 4
        gate.set()
        await held
        await fits
        assert front.in_flight == 0

    asyncio.run(run())


def test_a_late_embedder_is_a_503_and_frees_its_texts(embedder: Embedder, texts: list[str]) -> None:
    async def never(missing: list[str]) -> tuple[np.ndarray, tuple[int, ...]]:
        await asyncio.Event().wait()
        raise AssertionError

    async def run() -> None:
        front = TextFront(16 << 20, 4, 0.05, 1)
        with pytest.raises(ApiError, match="did not answer within"):
            await front.embed(_manifest(embedder), [texts[0]], never)
        assert front.in_flight == 0

    asyncio.run(run())


def test_a_requests_misses_go_to_the_embedder_in_small_calls(embedder: Embedder, texts: list[str]) -> None:
    """Misses are sent in calls of at most CALL_TEXTS (an embedder replica batches whatever calls
    are queued, so other requests' calls interleave with a large one's), joined back in order, the
    truncated positions mapped back too."""
    from shardserve.embed.front import CALL_TEXTS

    calls = []

    async def call(missing: list[str]) -> tuple[np.ndarray, tuple[int, ...]]:
        calls.append(len(missing))
        embedded = embedder.embed_batch(missing)
        return embedded.vectors, embedded.truncated

    asked = texts[:40]
    asked[35] = " ".join(texts) * 2  # past the token limit, in the third call
    got = asyncio.run(TextFront(0, 64, 30.0, 1).embed(_manifest(embedder), asked, call))
    assert calls == [CALL_TEXTS, CALL_TEXTS, 40 - 2 * CALL_TEXTS]
    assert np.array_equal(got.vectors, embedder.embed(asked))
    assert 35 in got.truncated and got.truncated == embedder.embed_batch(asked).truncated
