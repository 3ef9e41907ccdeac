"""OpenAPI document and /docs page for the router, built once from the pydantic models.

The router serves requests without FastAPI's per-request middleware stack, which runs on
the hot path for every request; FastAPI is still what renders the schema and the Swagger UI.
"""

from __future__ import annotations

import functools
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html

from shardserve.query.api import (
    CountRequest,
    DeleteRequest,
    PointsRequest,
    ScrollRequest,
    SearchRequest,
    SearchResponse,
    UpsertRequest,
    WriteResponse,
)
from shardserve.query.parse import NPY_CONTENT_TYPE
from shardserve.transport.http_front import Reply

_ERRORS: dict[int | str, dict[str, Any]] = {413: {"description": "body too large"},
           422: {"description": "a field is wrong: the body names it"},
           503: {"description": "overloaded, not ready, or partial with require_full (Retry-After)"}}


def _describe() -> FastAPI:
    app = FastAPI(title="shardserve", version="1",
                  description="Sharded FAISS vector search on Ray Serve: every query fans out to all "
                              "shards; the router merges their top-k.")

    @app.post("/v1/search", response_model=SearchResponse, responses=_ERRORS)
    def search(request: SearchRequest) -> SearchResponse:  # pragma: no cover - schema only
        """k nearest neighbours of one vector (`vector`) or of a batch (`vectors`)."""
        raise NotImplementedError

    writes = {**_ERRORS, 501: {"description": "the index is on remote storage (no write log), or its "
                                                "index kind takes no writes"},
              503: {"description": "write backlog full: compact (Retry-After)"}}

    @app.post("/v1/upsert", response_model=WriteResponse, responses=writes)
    def upsert(request: UpsertRequest) -> WriteResponse:  # pragma: no cover - schema only
        """Insert or replace points; a 200 means durable and visible to every later search."""
        raise NotImplementedError

    @app.post("/v1/delete", response_model=WriteResponse, responses=writes)
    def delete(request: DeleteRequest) -> WriteResponse:  # pragma: no cover - schema only
        """Delete points by id; a 200 means no later search answers them."""
        raise NotImplementedError

    points = {**_ERRORS, 503: {"description": "a shard did not answer in time (Retry-After)"}}

    @app.post("/v1/points", responses=points)
    def get_points(request: PointsRequest) -> dict:  # pragma: no cover - schema only
        """The points held among `ids`, in the order asked: {"points": [{"id", "metadata", "vector"?}]}."""
        raise NotImplementedError

    @app.post("/v1/count", responses=points)
    def count(request: CountRequest) -> dict:  # pragma: no cover - schema only
        """The points held now, those `filter` matches when given: {"count"}."""
        raise NotImplementedError

    @app.post("/v1/scroll", responses=points)
    def scroll(request: ScrollRequest) -> dict:  # pragma: no cover - schema only
        """A page of the points held in ascending id order past `after`: {"points", "next"}."""
        raise NotImplementedError

    @app.get("/v1/health", responses={503: {"description": "a shard is not loaded"}})
    def health() -> dict:  # pragma: no cover - schema only
        """200 when every shard answers."""
        raise NotImplementedError

    @app.get("/v1/index")
    def index() -> dict:  # pragma: no cover - schema only
        """Summary of the manifest being served and the request limits."""
        raise NotImplementedError

    return app


_NPY_QUERY = [("k", "integer", "neighbours to return (default 10)"),
              ("nprobe", "integer", "IVF lists per shard"), ("efSearch", "integer", "HNSW search depth"),
              ("include", "string", "metadata columns, comma-separated"),
              ("require_full", "boolean", "503 instead of a partial answer")]


def openapi_document() -> dict:
    """The pydantic-generated document, plus the .npy bodies that /v1/search (its other fields in
    the query string: shardserve.query.parse.parse_npy_request), /v1/upsert and /v1/delete also
    take (shardserve.writes.parse)."""
    document = _describe().openapi()
    search = document["paths"]["/v1/search"]["post"]
    search["requestBody"]["content"][NPY_CONTENT_TYPE] = {"schema": {
        "type": "string", "format": "binary",
        "description": "one float array in NumPy's .npy format: (dim,) for one query, (n, dim) for a "
                       "batch; the other fields in the query string"}}
    search["parameters"] = [{"name": name, "in": "query", "required": False,
                             "description": f"{text} (.npy bodies only)", "schema": {"type": kind}}
                            for name, kind, text in _NPY_QUERY]
    for route, holds in (("/v1/upsert", "the ids ((n,) integers), then the vectors ((n, dim) floats); no "
                                        "metadata"),
                         ("/v1/delete", "the ids ((n,) integers) alone")):
        document["paths"][route]["post"]["requestBody"]["content"][NPY_CONTENT_TYPE] = {"schema": {
            "type": "string", "format": "binary",
            "description": f"NumPy .npy arrays one after the other (bulk loads): {holds}"}}
    return document


@functools.cache
def _openapi_json() -> bytes:
    return orjson.dumps(openapi_document())


def docs_reply(route: str, root: str) -> Reply | None:
    """GET /openapi.json or /docs under the route prefix `root` (None: not a docs route)."""
    if route == "/openapi.json":
        return Reply(200, _openapi_json())
    if route == "/docs":
        return Reply(200, docs_page(f"{root}/openapi.json"), "text/html")
    return None


def docs_page(openapi_url: str) -> bytes:
    return bytes(get_swagger_ui_html(openapi_url=openapi_url, title="shardserve API").body)
