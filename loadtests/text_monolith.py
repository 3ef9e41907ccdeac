"""What a user would write instead of shardserve to search text: uvicorn + FastAPI + ONNX Runtime +
FAISS, one worker process per core.

Each worker loads the index's embedding model (the manifest's `embedder`, resolved and checked by
content exactly as shardserve does: shardserve.embed.model.Embedder, the same files) with ONNX Runtime
at one intra-op thread, and the index's shards merged into ONE index (IVF lists merge exactly, since
the shards share their quantizer; a flat index's vectors go into one flat index; other kinds are
searched shard by shard and merged). So a request pays one model run and one FAISS search in the
process that parsed it, no hop: a worker per core, a thread each, the strongest simple rival
(loadtests/baseline_server.py is the same for vector queries).

    POST /v1/search {"text": "...", "k": 10, "params": {...}}   (or "texts": [...], a batch)

answers as shardserve's /v1/search does (shardserve.query.render.render_search: ids and distances of
the top k). No embedding cache unless `--cache-entries N` asks for one: an LRU of N vectors by exact
text per worker, what the services shardserve replaces keep (a dict in use order).

    python -m loadtests.text_monolith INDEX_DIR [--port 8110] [--workers N] [--cache-entries N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import faiss
import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from shardserve.embed.validate import check_text, check_texts
from shardserve.index.indexes import make_empty_index, prepare_vectors, stored_points, supported_params
from shardserve.index.manifest import Manifest
from shardserve.query.api import KNOWN_PARAMS, ApiError, ParsedQuery
from shardserve.query.merge import QueryResult, merge_topk
from shardserve.query.render import render_search
from shardserve.query.searcher import ShardSearcher, load_all_shards

INDEX_ENV = "SHARDSERVE_TEXT_MONOLITH_INDEX"
CACHE_ENV = "SHARDSERVE_TEXT_MONOLITH_CACHE_ENTRIES"
MAX_K = 100
FIELDS = ("text", "texts", "k", "params", "require_full")
NOT_HERE = ("filter", "include")  # shardserve's request fields this rival does not implement


class Searches(Protocol):
    """What TextSearcher needs of a vector searcher (shardserve.query.searcher.ShardSearcher's API)."""

    metric: str

    def search(self, queries: np.ndarray, k: int, params: dict | None = None,
               prepared: bool = False) -> tuple[np.ndarray, np.ndarray, float]: ...


class Embeds(Protocol):
    """What TextSearcher needs of an embedder (shardserve.embed.model.Embedder)."""

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


class EachShard:
    """Shards that merge into no single index (HNSW, PQ, refined IVF...): each searched in turn, the
    answers merged (shardserve.query.merge.merge_topk, the router's own merge)."""

    def __init__(self, shards: list[ShardSearcher]):
        self.shards = shards
        self.metric = shards[0].metric

    def search(self, queries: np.ndarray, k: int, params: dict | None = None,
               prepared: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
        matrix = queries if prepared else prepare_vectors(queries, self.metric)
        start = time.perf_counter()
        parts = [shard.search(matrix, k, params, prepared=True) for shard in self.shards]
        distances, ids = merge_topk([part[0] for part in parts], [part[1] for part in parts], k,
                                    higher_is_better=self.metric != "l2")
        return distances, ids, (time.perf_counter() - start) * 1000.0


def merge_indexes(indexes: list[faiss.Index], metric: str) -> faiss.Index | None:
    """One index answering as the shards together do, or None when they merge into none.

    Plain IVF shards share their trained quantizer: their lists merge exactly (FAISS's merge_from).
    Shards that store the vectors themselves (a flat index under an id map) are added, under their ids,
    into one flat index of the same metric."""
    first = faiss.downcast_index(indexes[0])
    if isinstance(first, faiss.IndexIVF):
        merged = faiss.clone_index(indexes[0])
        for other in indexes[1:]:
            merged.merge_from(other, 0)
        return merged
    if not all(isinstance(index, faiss.IndexIDMap) for index in indexes):
        return None
    points = [stored_points(index) for index in indexes]
    if any(found is None for found in points):
        return None
    merged = make_empty_index("Flat", int(indexes[0].d), metric)  # IndexIDMap2(IndexFlat of the metric)
    for found in points:
        assert found is not None
        ids, vectors = found
        if len(ids):
            merged.add_with_ids(np.ascontiguousarray(vectors, np.float32), ids)
    return merged


def monolith_searcher(index_uri: str) -> tuple[Searches, Manifest]:
    """The index at `index_uri` as one searcher (`merge_indexes`, else `EachShard`), and its manifest."""
    manifest, shards = load_all_shards(index_uri, mmap=False)  # in memory: merged, or cloned
    merged = merge_indexes([shard.index for shard in shards], manifest.metric)
    searcher: Searches = (EachShard(shards) if merged is None
                          else ShardSearcher(merged, manifest.metric, "merged", manifest.index_version))
    return searcher, manifest


class LruEmbeddings:
    """At most `entries` vectors by exact text, the least recently used out first: an ordered dict.
    Not thread-safe: a worker answers on its event loop, one request at a time."""

    def __init__(self, entries: int):
        if entries < 1:
            raise ValueError(f"entries must be >= 1, got {entries}")
        self.entries = entries
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0

    def embed(self, embedder: Embeds, texts: Sequence[str]) -> np.ndarray:
        found: dict[str, np.ndarray] = {}
        missing: list[str] = []
        for text in texts:
            vector = self._vectors.get(text)
            if vector is not None:
                self._vectors.move_to_end(text)
                found[text] = vector
                self.hits += 1
            elif text not in found and text not in missing:
                missing.append(text)
                self.misses += 1
            else:
                self.hits += 1  # a repeat inside the batch: embedded once
        if missing:
            for text, vector in zip(missing, embedder.embed(missing), strict=True):
                found[text] = self._vectors[text] = vector.copy()
            while len(self._vectors) > self.entries:
                self._vectors.popitem(last=False)
        return np.stack([found[text] for text in texts])

    def __len__(self) -> int:
        return len(self._vectors)


class TextSearcher:
    """Texts to their top k: embed (through the LRU when there is one), then one vector search."""

    def __init__(self, searcher: Searches, embedder: Embeds, cache_entries: int = 0):
        self.searcher, self.embedder = searcher, embedder
        self.cache = LruEmbeddings(cache_entries) if cache_entries else None

    @property
    def metric(self) -> str:
        return self.searcher.metric

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embedder.embed(texts) if self.cache is None else self.cache.embed(self.embedder, texts)

    def search(self, texts: Sequence[str], k: int, params: dict | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """(vectors, distances, ids, compute milliseconds: embedding + search) for `texts`."""
        start = time.perf_counter()
        vectors = prepare_vectors(self.embed(texts), self.metric)
        distances, ids, _ = self.searcher.search(vectors, k, params, prepared=True)
        return vectors, distances, ids, (time.perf_counter() - start) * 1000.0


@dataclass(frozen=True, kw_only=True)
class TextQuery:
    """A checked text request."""

    texts: list[str]
    k: int
    params: tuple[tuple[str, int], ...]
    single: bool
    require_full: bool


def parse_text_request(body: bytes, supported: frozenset[str], max_k: int = MAX_K) -> TextQuery:
    """A /v1/search text body, checked as shardserve checks one (shardserve.embed.validate for the
    texts, the vector parser's rules for k and params): ApiError(422) naming the field at fault."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(422, "body", f"body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ApiError(422, "body", "body must be a JSON object")
    for name in NOT_HERE:
        if payload.get(name) is not None:
            raise ApiError(422, name, f"{name!r} is not implemented by this monolith")
    unknown = set(payload) - set(FIELDS) - set(NOT_HERE)
    if unknown:
        raise ApiError(422, sorted(unknown)[0], f"unknown field(s) {sorted(unknown)}")
    single = "text" in payload
    if single == ("texts" in payload):
        raise ApiError(422, "text", "give exactly one of 'text' or 'texts'")
    texts = [check_text(payload["text"])] if single else check_texts(payload["texts"])
    k = payload.get("k", 10)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= max_k:
        raise ApiError(422, "k", f"k must be an integer in [1, {max_k}], got {k!r}")
    params = payload.get("params") or {}
    if not isinstance(params, dict):
        raise ApiError(422, "params", "params must be an object")
    for name, number in params.items():
        if name not in KNOWN_PARAMS or name not in supported:
            raise ApiError(422, f"params.{name}", f"param {name!r} does not apply to this index "
                                                  f"(supported: {sorted(supported) or 'none'})")
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65536:
            raise ApiError(422, f"params.{name}", f"{name} must be an integer in [1, 65536]")
    require_full = payload.get("require_full", False)
    if not isinstance(require_full, bool):
        raise ApiError(422, "require_full", "require_full must be true or false")
    return TextQuery(texts=texts, k=k, params=tuple(sorted(params.items())), single=single,
                     require_full=require_full)


def text_app(searcher: TextSearcher, index_version: str, supported: frozenset[str]) -> FastAPI:
    """The HTTP app around a TextSearcher: /v1/search and /v1/health."""
    app = FastAPI(title="text search monolith (uvicorn + ONNX Runtime + FAISS)")

    @app.post("/v1/search")
    async def search(request: Request) -> Response:
        started = time.perf_counter()
        try:
            query = parse_text_request(await request.body(), supported)
        except ApiError as error:
            return Response(error.body(), status_code=error.status, media_type="application/json")
        vectors, distances, ids, compute_ms = searcher.search(query.texts, query.k, dict(query.params))
        answered = ParsedQuery(matrix=vectors, k=query.k, params=query.params, single=query.single,
                               require_full=query.require_full)
        result = QueryResult(distances=distances, ids=ids, answered=1, shards=1, compute_ms=compute_ms,
                             fanout_ms=0.0, batch_size=len(vectors))
        body = render_search(answered, result, (time.perf_counter() - started) * 1000, index_version)
        return Response(body, media_type="application/json")

    @app.get("/v1/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


def load_text_searcher(index_uri: str, cache_entries: int = 0) -> tuple[TextSearcher, str, frozenset[str]]:
    """The index's text searcher: its model (checked against the manifest's embedder identity) and its
    shards as one searcher; with its index version and the params its factory takes."""
    from shardserve.embed.model import Embedder
    from shardserve.embed.model_files import resolve_model

    searcher, manifest = monolith_searcher(index_uri)
    if manifest.embedder is None:
        raise SystemExit(f"{index_uri} was not built from text: its manifest names no embedder")
    embedder = Embedder(resolve_model(manifest.embedder.name), intra_op_threads=1)
    embedder.check(manifest.embedder)
    return (TextSearcher(searcher, embedder, cache_entries), manifest.index_version,
            supported_params(manifest.index_factory, manifest.dim, manifest.metric))


def create_app() -> FastAPI:
    """uvicorn's factory, in every worker."""
    faiss.omp_set_num_threads(1)  # one worker per core: more threads than cores is ~2x slower
    searcher, version, supported = load_text_searcher(os.environ[INDEX_ENV],
                                                      int(os.environ.get(CACHE_ENV, "0")))
    searcher.embed(["warm"])  # the model's first run allocates its buffers: not in a request
    return text_app(searcher, version, supported)


def main() -> None:
    try:
        import uvicorn
    except ImportError:
        raise SystemExit("the text monolith needs uvicorn, in the bench extra: "
                         "pip install -e '.[bench]'") from None

    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("index")
    cli.add_argument("--host", default="127.0.0.1")
    cli.add_argument("--port", type=int, default=8110)
    cli.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    cli.add_argument("--cache-entries", type=int, default=0,
                     help="an LRU of this many embeddings per worker, by exact text (default: no cache)")
    args = cli.parse_args()
    if args.cache_entries < 0 or args.workers < 1:
        cli.error("--cache-entries must be >= 0 and --workers >= 1")
    os.environ[INDEX_ENV] = os.path.abspath(args.index)
    os.environ[CACHE_ENV] = str(args.cache_entries)
    uvicorn.run("loadtests.text_monolith:create_app", factory=True, host=args.host, port=args.port,
                workers=args.workers, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
