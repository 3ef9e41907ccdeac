"""The router's text front: text bodies into texts, texts into vectors through the cache and the
embedder, under an admission of their own. Plain asyncio, no Ray: the embedder is any coroutine.

    POST /v1/search  {"text": "...", k, params, filter, include}   or {"texts": [...], ...}
    POST /v1/upsert  {"ids": [...], "texts": [...], "metadata": [...]}
    POST /v1/embed   {"texts": [...]}

Why text has an admission of its own: a text the cache misses costs a model run (milliseconds of CPU,
many times a vector search), so a bound counted in requests lets a text flood fill every slot and
starve vector searches, or lets vector searches starve texts. Texts waiting for the embedder are
counted (`max_texts_in_flight`, per router replica); a request whose misses would pass it gets a
503 with Retry-After at once, before any model work. A cache hit is never refused, nor a request
that finds no text waiting (however many it carries: `max_texts` bounds it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import orjson

from shardserve.embed.cache import EmbeddingCache
from shardserve.embed.validate import MAX_TEXT_CHARS, MAX_TEXTS, check_text, check_texts
from shardserve.errors import ServingError
from shardserve.index.manifest import Manifest
from shardserve.query.api import ApiError, TextLimits

# A coroutine that embeds texts: (float32 (n, dim), positions truncated at the model's token limit).
EmbedCall = Callable[[list[str]], Awaitable[tuple[np.ndarray, tuple[int, ...]]]]
SEARCH_TEXT_FIELDS = ("text", "texts")


@dataclass(frozen=True, kw_only=True)
class Embedded:
    """A request's texts as vectors, and what the answer says of them."""

    vectors: np.ndarray  # float32 (n, dim), in the request's order
    truncated: tuple[int, ...]  # positions of the texts the model read only its token limit of
    cached: int  # texts answered by the cache
    ms: float  # time from the lookup to the last vector

    def describe(self, manifest: Manifest) -> dict:
        """The answer's `embedding` field (and `ms`, which the answer puts under timing_ms)."""
        assert manifest.embedder is not None
        return {"model": manifest.embedder.name, "truncated": list(self.truncated),
                "max_tokens": manifest.embedder.max_tokens, "cached": self.cached, "ms": self.ms}


def text_search(body: bytes, max_texts: int = MAX_TEXTS,
                max_chars: int = MAX_TEXT_CHARS) -> tuple[dict, list[str], bool] | None:
    """A JSON /v1/search body that asks by text: (its payload, its texts, single); None when it asks
    by vector (the vector parser then reads it: the same body, parsed once more only if it names a
    text field anywhere, e.g. in a filter). A 422 names `text` for text beside vectors."""
    if b'"text' not in body:
        return None
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the vector parser says what is wrong with it
    if not isinstance(payload, dict) or not any(field in payload for field in SEARCH_TEXT_FIELDS):
        return None
    if "text" in payload and "texts" in payload:
        raise ApiError(422, "text", "give exactly one of 'text' or 'texts'")
    if "vector" in payload or "vectors" in payload:
        raise ApiError(422, "text", "give either text(s) or vector(s), not both")
    if "text" in payload:
        return payload, [check_text(payload.pop("text"), max_chars=max_chars)], True
    return payload, check_texts(payload.pop("texts"), max_texts=max_texts, max_chars=max_chars), False


def text_upsert(body: bytes, max_points: int,
                max_chars: int = MAX_TEXT_CHARS) -> tuple[dict, list[str]] | None:
    """A JSON /v1/upsert body with `texts` in place of `vectors`: (its payload without them, the
    texts); None for a body of vectors. The texts are bounded by the request's points."""
    if b'"texts"' not in body:
        return None
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or "texts" not in payload:
        return None
    if "vectors" in payload:
        raise ApiError(422, "texts", "give either texts or vectors, not both")
    texts = check_texts(payload.pop("texts"), max_texts=max_points, max_chars=max_chars)
    if isinstance(payload.get("ids"), list) and len(payload["ids"]) != len(texts):
        raise ApiError(422, "texts", f"texts must be aligned with ids: {len(payload['ids'])} ids, "
                                     f"{len(texts)} texts")
    return payload, texts


def upsert_body(payload: dict, vectors: np.ndarray) -> bytes:
    """The upsert body the log takes: the payload with the texts' vectors in place of the texts.
    orjson writes a float32 as the shortest decimal that reads back as the same float32: the vector
    logged is the model's, bit for bit (tests/test_text_front.py)."""
    return orjson.dumps({**payload, "vectors": vectors}, option=orjson.OPT_SERIALIZE_NUMPY)


def embed_request(body: bytes, max_texts: int = MAX_TEXTS, max_chars: int = MAX_TEXT_CHARS) -> list[str]:
    """A /v1/embed body: its texts (a 422 naming the field at fault)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(422, "body", f"body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ApiError(422, "body", "body must be a JSON object")
    if unknown := sorted(set(payload) - {"texts"}):
        raise ApiError(422, unknown[0], f"unknown field(s) {unknown}: use ['texts']")
    return check_texts(payload.get("texts"), max_texts=max_texts, max_chars=max_chars)


def needs_embedder(manifest: Manifest, field: str = "text") -> None:
    """A 422 naming `field` for an index built from vectors: it has no model to read text with."""
    if manifest.embedder is None:
        raise ApiError(422, field, "this index was built from vectors, without an embedder: send "
                                   "vectors, or build it from text (shardserve build --text-column ... "
                                   "--embedder ...)")


# Texts per embedder call: a request's misses go in calls of at most this many, so the replicas'
# batches (AdaptiveBatcher, whatever calls are queued) interleave requests instead of one large
# request holding a replica's model thread for all its texts.
CALL_TEXTS = 16


async def _in_calls(call: EmbedCall, texts: list[str]) -> tuple[np.ndarray, tuple[int, ...]]:
    """`call` over `texts` in CALL_TEXTS pieces at once, their answers joined in order."""
    if len(texts) <= CALL_TEXTS:
        return await call(texts)
    starts = range(0, len(texts), CALL_TEXTS)
    answers = await asyncio.gather(*[call(texts[start:start + CALL_TEXTS]) for start in starts])
    vectors = np.concatenate([vectors for vectors, _ in answers])
    cut = tuple(start + i for start, (_, truncated) in zip(starts, answers, strict=True) for i in truncated)
    return vectors, cut


class TextFront:
    """One router replica's texts: the cache, then the embedder for the misses, under the text
    admission (see the module docstring).

    Arguments:
        cache_bytes: the embedding cache's bound (0: no cache).
        max_texts_in_flight: texts this replica may have waiting for the embedder at once.
        timeout_s: how long a request waits for the embedder before a 503.
        retry_after_s: the Retry-After of its 503s.
        max_texts, max_text_chars: what one request may carry (`limits`, for GET /v1/index).
    """

    def __init__(self, cache_bytes: int, max_texts_in_flight: int, timeout_s: float, retry_after_s: int,
                 max_texts: int = MAX_TEXTS, max_text_chars: int = MAX_TEXT_CHARS):
        self.cache = EmbeddingCache(cache_bytes)
        self.limits = TextLimits(max_texts, max_text_chars, max_texts_in_flight, cache_bytes)
        self.max_texts_in_flight = max_texts_in_flight
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.in_flight = 0  # texts sent to the embedder, not yet answered
        self.shed = 0  # requests refused by the text admission

    async def embed(self, manifest: Manifest, texts: list[str], call: EmbedCall) -> Embedded:
        """The vectors of `texts` under `manifest`'s model: hits from the cache, the misses (each
        distinct text once) from `call`, then kept."""
        assert manifest.embedder is not None
        started = time.perf_counter()
        lookup = self.cache.lookup(manifest.embedder.sha256, texts)
        missing = list(lookup.missing)
        fresh: np.ndarray | None = None
        cut: tuple[int, ...] = ()
        if missing:
            if self.in_flight and self.in_flight + len(missing) > self.max_texts_in_flight:
                self.shed += 1
                raise ApiError(503, None, f"overloaded: {self.in_flight} texts waiting for the embedder",
                               self.retry_after_s)
            self.in_flight += len(missing)
            try:
                async with asyncio.timeout(self.timeout_s):
                    fresh, cut = await _in_calls(call, missing)
            except TimeoutError:
                raise ApiError(503, None, f"the embedder did not answer within {self.timeout_s} s",
                               self.retry_after_s) from None
            finally:
                self.in_flight -= len(missing)
            if fresh.shape != (len(missing), manifest.embedder.dim) or fresh.dtype != np.float32:
                raise ServingError(f"the embedder answered {fresh.dtype} {fresh.shape} for {len(missing)} "
                                   f"texts of dim {manifest.embedder.dim}")
        vectors, truncated = self.cache.complete(lookup, fresh, cut, manifest.embedder.dim)
        return Embedded(vectors=vectors, truncated=truncated, cached=len(texts) - sum(
            len(rows) for rows in lookup.missing.values()), ms=(time.perf_counter() - started) * 1000.0)
