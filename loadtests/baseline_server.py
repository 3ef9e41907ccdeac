"""What a user would pick instead: plain uvicorn + FastAPI + FAISS, one worker process per core.

Each worker loads the same shards and merges them into ONE index (IVF lists merge exactly, since the
shards share their quantizer), so the baseline pays no fan-out at all: the strongest simple rival.
python -m loadtests.baseline_server INDEX_DIR [--port 8100] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import time

import faiss
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from shardserve.index.indexes import prepare_vectors, supported_params
from shardserve.query.api import ApiError
from shardserve.query.parse import is_npy, parse_npy_request, parse_search_request
from shardserve.query.searcher import ShardSearcher, load_all_shards

INDEX_ENV = "SHARDSERVE_BASELINE_INDEX"


def merged_searcher(index_uri: str) -> tuple[ShardSearcher, frozenset[str]]:
    manifest, shards = load_all_shards(index_uri, mmap=False)  # merged into one in-memory index
    first = shards[0].index
    if faiss.try_extract_index_ivf(first) is None:
        raise SystemExit("baseline server merges IVF shards only")
    merged = faiss.clone_index(first)
    for other in shards[1:]:
        merged.merge_from(other.index, 0)
    return (ShardSearcher(merged, manifest.metric, "merged", manifest.index_version),
            supported_params(manifest.index_factory, manifest.dim, manifest.metric))


def create_app() -> FastAPI:
    faiss.omp_set_num_threads(1)  # one worker per core: more threads than cores is ~2x slower
    searcher, _ = merged_searcher(os.environ[INDEX_ENV])
    app = FastAPI(title="shardserve baseline")

    @app.post("/v1/search")
    async def search(request: Request) -> Response:
        started = time.perf_counter()
        try:
            body, kind = await request.body(), request.headers.get("content-type", "")
            query = (parse_npy_request(body, request.url.query, searcher.dim, 100, 1024) if is_npy(kind)
                     else parse_search_request(body, searcher.dim, 100, 1024))
        except ApiError as error:
            return Response(error.body(), status_code=error.status, media_type="application/json")
        matrix = prepare_vectors(query.matrix, searcher.metric)
        distances, ids, compute_ms = searcher.search(matrix, query.k, dict(query.params), prepared=True)
        total = (time.perf_counter() - started) * 1000
        answer: dict = {"ids": ids[0], "distances": distances[0]} if query.single else {
            "results": [{"ids": i, "distances": d} for i, d in zip(ids, distances, strict=True)]}
        answer["timing_ms"] = {"total": total, "compute": compute_ms, "queue": total - compute_ms}
        return Response(orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY),
                        media_type="application/json")

    @app.get("/v1/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


def main() -> None:
    try:
        import uvicorn
    except ImportError:
        raise SystemExit("the baseline server needs uvicorn, in the bench extra: "
                         "pip install -e '.[bench]'") from None

    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("index")
    cli.add_argument("--host", default="127.0.0.1")
    cli.add_argument("--port", type=int, default=8100)
    cli.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = cli.parse_args()
    os.environ[INDEX_ENV] = os.path.abspath(args.index)
    uvicorn.run("loadtests.baseline_server:create_app", factory=True, host=args.host, port=args.port,
                workers=args.workers, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
