"""The Python client of the HTTP API: `from shardserve import Client`.

    client = Client("http://127.0.0.1:8000")
    hits = client.search(vector, k=10, params={"nprobe": 16}, include=["caption"])
    hits.ids, hits.distances, hits.metadata
    many = client.search_batch(matrix, k=10)        # one Hits per row
    hits = client.search(text="a fool and his money")   # an index built from text (--embedder)
    client.upsert([70003], texts=["soon parted"])    # embedded by the server, then logged
    vectors = client.embed(["a fool and his money"])  # float32 (1, dim), the index's model
    client.upsert([70001, 70002], matrix[:2], metadata=[{"label": 3}, None])  # {"position": ...}
    client.delete([70001])                           # a 200: durable, and seen by any later search

`AsyncClient` has the same methods, awaited. Vectors go out as JSON (numpy arrays serialised by
orjson); an answer that is not 200 raises `ApiError` carrying the server's message and the field it
names, and its status (503 carries `retry_after`).

On a cluster, give every edge: `Client(["http://10.0.1.5:8000", "http://10.0.2.7:8000"])` uses
the first until it cannot be reached, then the next (and stays there). A request moves on only
when it surely did not reach the edge (the connection failed): a search, or a write whose
connection broke after it was sent, raises instead, since the write may have been applied. An
answer, a 503 included, is the edge's answer: overload is not failed over.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import numpy as np
import orjson

from shardserve.errors import ApiError, BadArgument

__all__ = ["ApiError", "AsyncClient", "Client", "Hits"]


@dataclass(frozen=True)
class Hits:
    """One query's answer: ids best first, their distances (squared L2, or similarity for ip and
    cosine), metadata rows when `include` asked for columns."""

    ids: np.ndarray
    distances: np.ndarray
    metadata: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # coverage, timing_ms, index, matched


def _body(vectors: np.ndarray | None, text: Any, single: bool, k: int, params: dict | None,
          include: list[str] | None, options: dict[str, Any]) -> bytes:
    """A search body by vector(s) or by text(s), one of the two."""
    if (vectors is None) == (text is None):
        raise BadArgument("search: give a vector or a text, one of the two" if single else
                          "search_batch: give vectors or texts, one of the two")
    if text is not None and not single and isinstance(text, str):
        raise BadArgument("search_batch: texts must be a list of strings, not one string")
    key = ("vector" if single else "vectors") if text is None else ("text" if single else "texts")
    value = np.asarray(vectors, np.float32) if text is None else (text if single else list(text))
    body: dict[str, Any] = {key: value, "k": k, **options}
    if params:
        body["params"] = params
    if include:
        body["include"] = include
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def _hits(result: dict, shared: dict) -> Hits:
    return Hits(np.asarray(result["ids"], np.int64), np.asarray(result["distances"], np.float32),
                result.get("metadata"), shared)


def _answer(response: httpx.Response) -> dict:
    if response.status_code in (200, 201):  # 201: a collection created
        return orjson.loads(response.content)
    try:
        payload = orjson.loads(response.content)
        message, named = payload.get("error", response.text), payload.get("field")
    except (orjson.JSONDecodeError, AttributeError):
        message, named = response.text[:300], None
    retry = response.headers.get("retry-after")
    raise ApiError(response.status_code, named, message, float(retry) if retry else None)


def _single(payload: dict) -> Hits:
    shared = {key: value for key, value in payload.items() if key not in ("ids", "distances", "metadata")}
    return _hits(payload, shared)


def _batch(payload: dict) -> list[Hits]:
    shared = {key: value for key, value in payload.items() if key != "results"}
    return [_hits(result, shared) for result in payload["results"]]


_JSON = {"content-type": "application/json"}
_NPY = {"content-type": "application/x-npy"}  # an upsert without metadata: ids then vectors
# The connection never reached the edge: nothing was sent, any request may go to the next edge.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
CONNECT_TIMEOUT_S = 3.0  # an edge that does not accept a connection by then is taken as down
Http = TypeVar("Http", httpx.Client, httpx.AsyncClient)


class _Edges(Generic[Http]):
    """The endpoints a client may use, and which one it uses now."""

    def __init__(self, urls: str | Sequence[str], make: Callable[[str], Http]):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise BadArgument("a client needs at least one endpoint URL")
        self.clients: list[Http] = [make(url.rstrip("/")) for url in urls]
        self.current = 0

    def failed(self, edge: int, tried: int) -> int | None:
        """Edge `edge` could not be reached: the next one to try (None once all were tried). The
        client moves on from it, unless a concurrent request already moved elsewhere."""
        if tried + 1 >= len(self.clients):
            return None
        following = (edge + 1) % len(self.clients)
        if self.current == edge:
            self.current = following
        return following


def _upsert_body(ids: Any, vectors: np.ndarray | None, metadata: list[dict | None] | None,
                 texts: Sequence[str] | None = None) -> tuple[bytes, dict]:
    """Without metadata: the ids then the vectors as two .npy arrays (no JSON numbers to write or
    parse); with it, or with texts in place of vectors, JSON."""
    if (vectors is None) == (texts is None):
        raise BadArgument("upsert: give vectors or texts, one of the two")
    if isinstance(texts, str):
        raise BadArgument("upsert: texts must be a list of strings, one per id")
    if texts is not None:
        return orjson.dumps({"ids": [int(i) for i in ids], "texts": list(texts),
                             **({"metadata": metadata} if metadata is not None else {})}), _JSON
    if metadata is None:
        try:
            id_array = np.asarray([int(i) for i in ids], np.int64)
        except OverflowError:  # past int64: sent as given, for the server's 422
            id_array = None
        if id_array is not None:
            return _npy(id_array) + _npy(np.asarray(vectors, np.float32)), _NPY
    body: dict[str, Any] = {"ids": [int(i) for i in ids], "vectors": np.asarray(vectors, np.float32)}
    if metadata is not None:
        body["metadata"] = metadata
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), _JSON


def _embed_body(texts: Sequence[str]) -> bytes:
    if isinstance(texts, str):
        raise BadArgument("embed: give a list of texts")
    return orjson.dumps({"texts": list(texts)})


def _vectors(payload: dict) -> np.ndarray:
    return np.asarray(payload["vectors"], np.float32).reshape(-1, payload["dim"])


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _delete_body(ids: Any, filter: dict | None) -> bytes:
    if (ids is None) == (filter is None):
        raise BadArgument("delete: give ids or a filter, one of the two")
    return orjson.dumps({"filter": filter} if filter is not None else {"ids": [int(i) for i in ids]})


@dataclass
class Point:
    """A stored point: its id, its metadata columns, and its vector when asked for."""

    id: int
    metadata: dict
    vector: np.ndarray | None = None


def _points(payload: dict) -> list[Point]:
    return [Point(p["id"], p["metadata"], None if "vector" not in p else np.asarray(p["vector"], np.float32))
            for p in payload["points"]]


def _get_body(ids: Any, include: list[str] | None, vectors: bool) -> bytes:
    return orjson.dumps({"ids": [int(i) for i in ids], "vectors": vectors,
                         **({} if include is None else {"include": include})})


def _scroll_body(after: int | None, limit: int, filter: dict | None, include: list[str] | None,
                 vectors: bool) -> bytes:
    return orjson.dumps({"after": after, "limit": limit, "vectors": vectors,
                         **({} if filter is None else {"filter": filter}),
                         **({} if include is None else {"include": include})})


class Client:
    """A blocking client of a shardserve endpoint. Arguments:
    url: the endpoint, e.g. http://127.0.0.1:8000, or a list of a cluster's edges (see above).
    api_key: sent as `Authorization: Bearer` when the edge wants one.
    timeout_s: per request (connecting: at most CONNECT_TIMEOUT_S, then the next edge).
    """

    def __init__(self, url: str | Sequence[str], api_key: str | None = None, timeout_s: float = 30.0):
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))
        self._edges = _Edges(url, lambda base: httpx.Client(base_url=base, timeout=timeout, headers=headers))
        self._base = "/v1"  # a collection's client: /v1/collections/NAME

    def _send(self, method: str, path: str, body: bytes | None = None,
              headers: dict | None = None) -> httpx.Response:
        edge, tried = self._edges.current, 0
        while True:
            http = self._edges.clients[edge]
            try:
                if body is None:
                    return http.request(method, path)
                return http.request(method, path, content=body, headers=headers or _JSON)
            except _NOT_SENT:
                following = self._edges.failed(edge, tried)
                if following is None:
                    raise
                edge, tried = following, tried + 1

    def _post(self, operation: str, body: bytes, headers: dict | None = None) -> httpx.Response:
        """POST to this client's index or collection: /v1/OPERATION or /v1/collections/NAME/OPERATION."""
        return self._send("POST", f"{self._base}/{operation}", body, headers)

    def search(self, vector: np.ndarray | None = None, k: int = 10, params: dict | None = None,
               include: list[str] | None = None, *, text: str | None = None, **options: Any) -> Hits:
        """The k nearest neighbours of one vector, or of one text (an index built from text: the
        server embeds it with the index's model; `extra["embedding"]` says if it was truncated).
        `options`: other request fields, e.g. require_full, filter."""
        body = _body(vector, text, True, k, params, include, options)
        return _single(_answer(self._post("search", body)))

    def search_batch(self, vectors: np.ndarray | None = None, k: int = 10, params: dict | None = None,
                     include: list[str] | None = None, *, texts: Sequence[str] | None = None,
                     **options: Any) -> list[Hits]:
        """The k nearest neighbours of every row of `vectors`, or of every text, in one request."""
        body = _body(vectors, texts, False, k, params, include, options)
        return _batch(_answer(self._post("search", body)))

    def upsert(self, ids: Any, vectors: np.ndarray | None = None, metadata: list[dict | None] | None = None,
               *, texts: Sequence[str] | None = None) -> dict:
        """Insert or replace points (ids int64 >= 0, one vector row or one text each, metadata
        aligned or None). Texts are embedded by the server before the write is logged. Returns
        {"position", "upserted"} once the write is durable and visible to every later search."""
        return _answer(self._post("upsert", *_upsert_body(ids, vectors, metadata, texts)))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 (len(texts), dim): the texts embedded by the served index's model (its cache first)."""
        return _vectors(_answer(self._post("embed", _embed_body(texts))))

    def delete(self, ids: Any = None, *, filter: dict | None = None) -> dict:
        """Delete points by id (an unknown id is no error), or every point a search's `filter` matches
        now. Returns {"position", "deleted"} once durable and visible ("position" None when a filter
        matched nothing: nothing was written)."""
        return _answer(self._post("delete", _delete_body(ids, filter)))

    def get(self, ids: Any, include: list[str] | None = None, vectors: bool = False) -> list[Point]:
        """The points held among `ids`, in the order asked (an unknown or deleted id is left out),
        with their metadata columns (`include`: those named; default all) and vectors if asked."""
        return _points(_answer(self._post("points", _get_body(ids, include, vectors))))

    def count(self, filter: dict | None = None) -> int:
        """The points held now (those a search's `filter` matches, when given)."""
        return int(_answer(self._post("count", orjson.dumps({"filter": filter})))["count"])

    def scroll(self, after: int | None = None, limit: int = 100, filter: dict | None = None,
               include: list[str] | None = None, vectors: bool = False) -> tuple[list[Point], int | None]:
        """One page of the points held, in ascending id order past `after`, and the `after` of the
        next page (None: the last page)."""
        body = _scroll_body(after, limit, filter, include, vectors)
        payload = _answer(self._post("scroll", body))
        return _points(payload), payload["next"]

    def create_collection(self, name: str, dim: int, metric: str = "l2", *,
                          metadata: dict[str, str] | None = None, **spec: Any) -> Client:
        """Create an empty collection (served exactly, grown into `index` past `grow_at` rows) and
        return its client. `metadata`: column -> kind ("string", "bool", "number", "int64", ...)."""
        body = orjson.dumps({"name": name, "dim": dim, "metric": metric, "metadata": metadata or {}, **spec})
        _answer(self._send("POST", "/v1/collections", body))
        return self.collection(name)

    def collection(self, name: str) -> Client:
        """A client of the collection `name`: search, upsert, delete, get, count and scroll there."""
        sub = copy.copy(self)
        sub._base = f"/v1/collections/{quote(name, safe='')}"
        return sub

    def collections(self) -> list[dict]:
        return list(_answer(self._send("GET", "/v1/collections"))["collections"])

    def drop_collection(self, name: str) -> dict:
        """Drop a collection: its points and files go; the name may be used again."""
        return _answer(self._send("DELETE", f"/v1/collections/{quote(name, safe='')}"))

    def health(self) -> dict:
        return _answer(self._send("GET", "/v1/health"))

    def index(self) -> dict:
        """The served index (`GET /v1/index`), or, on a collection's client, the collection: its spec,
        stage (`exact`, or `built` once grown), version and count."""
        return _answer(self._send("GET", "/v1/index" if self._base == "/v1" else self._base))

    def close(self) -> None:
        for http in self._edges.clients:
            http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """`Client`, for asyncio: the same methods, awaited."""

    def __init__(self, url: str | Sequence[str], api_key: str | None = None, timeout_s: float = 30.0):
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))
        self._edges = _Edges(url, lambda base: httpx.AsyncClient(base_url=base, timeout=timeout,
                                                                 headers=headers))
        self._base = "/v1"

    async def _send(self, method: str, path: str, body: bytes | None = None,
                    headers: dict | None = None) -> httpx.Response:
        edge, tried = self._edges.current, 0
        while True:
            http = self._edges.clients[edge]
            try:
                if body is None:
                    return await http.request(method, path)
                return await http.request(method, path, content=body, headers=headers or _JSON)
            except _NOT_SENT:
                following = self._edges.failed(edge, tried)
                if following is None:
                    raise
                edge, tried = following, tried + 1

    async def _post(self, operation: str, body: bytes, headers: dict | None = None) -> httpx.Response:
        return await self._send("POST", f"{self._base}/{operation}", body, headers)

    async def search(self, vector: np.ndarray | None = None, k: int = 10, params: dict | None = None,
                     include: list[str] | None = None, *, text: str | None = None, **options: Any) -> Hits:
        body = _body(vector, text, True, k, params, include, options)
        return _single(_answer(await self._post("search", body)))

    async def search_batch(self, vectors: np.ndarray | None = None, k: int = 10, params: dict | None = None,
                           include: list[str] | None = None, *, texts: Sequence[str] | None = None,
                           **options: Any) -> list[Hits]:
        body = _body(vectors, texts, False, k, params, include, options)
        return _batch(_answer(await self._post("search", body)))

    async def upsert(self, ids: Any, vectors: np.ndarray | None = None,
                     metadata: list[dict | None] | None = None, *,
                     texts: Sequence[str] | None = None) -> dict:
        return _answer(await self._post("upsert", *_upsert_body(ids, vectors, metadata, texts)))

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        return _vectors(_answer(await self._post("embed", _embed_body(texts))))

    async def delete(self, ids: Any = None, *, filter: dict | None = None) -> dict:
        return _answer(await self._post("delete", _delete_body(ids, filter)))

    async def get(self, ids: Any, include: list[str] | None = None, vectors: bool = False) -> list[Point]:
        return _points(_answer(await self._post("points", _get_body(ids, include, vectors))))

    async def count(self, filter: dict | None = None) -> int:
        return int(_answer(await self._post("count", orjson.dumps({"filter": filter})))["count"])

    async def scroll(self, after: int | None = None, limit: int = 100, filter: dict | None = None,
                     include: list[str] | None = None,
                     vectors: bool = False) -> tuple[list[Point], int | None]:
        payload = _answer(await self._send("POST", f"{self._base}/scroll",
                                           _scroll_body(after, limit, filter, include, vectors)))
        return _points(payload), payload["next"]

    async def create_collection(self, name: str, dim: int, metric: str = "l2", *,
                                metadata: dict[str, str] | None = None, **spec: Any) -> AsyncClient:
        body = orjson.dumps({"name": name, "dim": dim, "metric": metric, "metadata": metadata or {}, **spec})
        _answer(await self._send("POST", "/v1/collections", body))
        return self.collection(name)

    def collection(self, name: str) -> AsyncClient:
        sub = copy.copy(self)
        sub._base = f"/v1/collections/{quote(name, safe='')}"
        return sub

    async def collections(self) -> list[dict]:
        return list(_answer(await self._send("GET", "/v1/collections"))["collections"])

    async def drop_collection(self, name: str) -> dict:
        return _answer(await self._send("DELETE", f"/v1/collections/{quote(name, safe='')}"))

    async def health(self) -> dict:
        return _answer(await self._send("GET", "/v1/health"))

    async def index(self) -> dict:
        return _answer(await self._send("GET", "/v1/index" if self._base == "/v1" else self._base))

    async def aclose(self) -> None:
        for http in self._edges.clients:
            await http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
