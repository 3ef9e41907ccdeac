"""Chroma's v2 HTTP API (the part `chromadb.HttpClient` 1.5.9 uses) on shardserve's collections.

Routes under /api/v2: heartbeat, version, pre-flight-checks, auth/identity, reset, tenants,
databases, collections (create, get or create, get by name or id, list, count, modify, delete) and
each collection's add, update, upsert, delete, get, query and count. Answers and errors are
Chroma's shapes: an error is `{"error": <Chroma's error name>, "message": ...}` with a
`chroma-trace-id` header, which the client turns into its own exception classes.

A Chroma collection is a native collection (`chroma-<uuid hex>`, shardserve.chroma.catalogue):
its points have the native write log, growth, folds and serving apart; its records are
shardserve.chroma.records. Plain async Python: `native` is the native collections' routes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import parse_qs, unquote

import orjson

from shardserve.chroma import points as P
from shardserve.chroma.catalogue import ChromaCatalogue, ChromaCollection, Exists
from shardserve.chroma.records import ChromaRefusal, Limits, Records, Sequencer, dumps, invalid
from shardserve.query.api import ApiError

VERSION = "1.0.0"  # the server version Chroma's 1.5.9 server reports
NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9._-]{1,510}[a-zA-Z0-9]")
HNSW_DEFAULTS = {"space": "l2", "ef_construction": 100, "ef_search": 100, "max_neighbors": 16,
                 "sync_threshold": 1000, "resize_factor": 1.2}
LEGACY_KEYS = {"hnsw:space": "space", "hnsw:construction_ef": "ef_construction",
               "hnsw:search_ef": "ef_search", "hnsw:M": "max_neighbors",
               "hnsw:sync_threshold": "sync_threshold", "hnsw:resize_factor": "resize_factor"}
SPACES = ("l2", "ip", "cosine")
# native call: (method, route, body) where route is "" (the collections) or "{name}[/{op}]"
Call = Callable[[str, str, object], Awaitable[object]]

_NATIVE_ERRORS = {404: (404, "NotFoundError"), 409: (409, "UniqueConstraintError"),
                  422: (400, "InvalidArgumentError"), 413: (400, "InvalidArgumentError"),
                  503: (503, "ChromaError")}


def refusal_of(error: ApiError) -> ChromaRefusal:
    status, name = _NATIVE_ERRORS.get(error.status, (500, "InternalError"))
    return ChromaRefusal(status, name, error.message)


def error_body(refusal: ChromaRefusal) -> tuple[int, bytes, dict[str, str]]:
    return (refusal.status, orjson.dumps({"error": refusal.name, "message": refusal.message}),
            {"chroma-trace-id": secrets.token_hex(16)})


def _not_found(what: str) -> ChromaRefusal:
    return ChromaRefusal(404, "NotFoundError", what)


def _collection_missing(name: str) -> ChromaRefusal:
    return _not_found(f"Collection [{name}] does not exist")


def check_name(name: object) -> str:
    ok = isinstance(name, str) and bool(NAME.fullmatch(name)) and ".." not in name
    if ok:
        try:
            ipaddress.ip_address(str(name))
            ok = False
        except ValueError:
            pass
    if not ok:
        raise invalid("Expected a name containing 3-512 characters from [a-zA-Z0-9._-], starting and ending "
                      f"with a character in [a-zA-Z0-9]. Got: {str(name)[:600]}")
    return str(name)


def configured(configuration: dict | None, metadata: dict | None) -> dict:
    """The configuration_json Chroma's single-node server answers: its HNSW defaults, overlaid by the
    configuration's hnsw (or, when that sets nothing, by the legacy `hnsw:*` metadata keys), the
    space from spann when only spann is given."""
    configuration = configuration or {}
    if not isinstance(configuration, dict):
        raise invalid("configuration: an object")
    hnsw, spann = configuration.get("hnsw"), configuration.get("spann")
    if hnsw and spann:
        raise invalid("configuration: hnsw and spann cannot both be given")
    out = dict(HNSW_DEFAULTS)
    given = {k: v for k, v in (hnsw or {}).items() if v is not None and k in HNSW_DEFAULTS}
    out.update(given)
    if all(HNSW_DEFAULTS.get(k) == v for k, v in given.items()):
        for key, field in LEGACY_KEYS.items():
            if metadata and metadata.get(key) is not None:
                out[field] = metadata[key]
    if spann and spann.get("space") is not None:
        out["space"] = spann["space"]
    if out["space"] not in SPACES:
        raise invalid(f"space {str(out['space'])[:40]!r} is not one of {list(SPACES)}")
    return {"hnsw": out, "spann": None, "embedding_function": configuration.get("embedding_function")}


class ChromaFront:
    """Chroma's routes for one router replica. `root`: the collections directory (None: none
    there, a 501); `native(method, route, body)`: the native collections' routes."""

    def __init__(self, root: Path | None, native: Call, limits: Limits, shards: int, max_batch: int,
                 allow_reset: bool):
        self.root, self.native, self.limits = root, native, limits
        self.shards, self.max_batch, self.allow_reset = shards, max_batch, allow_reset
        self._catalogue: ChromaCatalogue | None = None
        self._dims: dict[str, int] = {}  # native dimension, once its collection exists (never changes)
        self._locks: dict[str, asyncio.Lock] = {}
        self.sequencer = Sequencer()

    async def catalogue(self) -> ChromaCatalogue:
        if self._catalogue is None:
            if self.root is None:
                raise ChromaRefusal(501, "ChromaError", "collections need a local directory "
                                                        "(collections_dir)")
            opened = await asyncio.to_thread(ChromaCatalogue, self.root)
            if self._catalogue is None:
                self._catalogue = opened
            else:
                opened.close()
        return self._catalogue

    async def _cat(self, method: str, *args: object):
        catalogue = await self.catalogue()
        return await asyncio.to_thread(getattr(catalogue, method), *args)

    async def respond(self, method: str, path: str, query: str, body: bytes) -> tuple[int, bytes, dict]:
        """(status, JSON body, headers) for /api/v2`path`."""
        try:
            payload = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError as exc:
            return error_body(invalid(f"body is not JSON: {exc}"))
        try:
            answer = await self._route(method, [unquote(p) for p in path.strip("/").split("/") if p],
                                       parse_qs(query), payload)
            return 200, dumps(answer), {}
        except ChromaRefusal as refusal:
            return error_body(refusal)
        except ApiError as error:
            return error_body(refusal_of(error))

    async def _route(self, method: str, parts: list[str], query: dict, payload: object) -> object:
        if not parts or parts == ["heartbeat"]:
            return {"nanosecond heartbeat": time.time_ns()}
        head = parts[0]
        if parts == ["version"]:
            return VERSION
        if parts == ["pre-flight-checks"]:
            return {"max_batch_size": self.max_batch, "supports_base64_encoding": True}
        if parts == ["auth", "identity"]:
            return {"user_id": "", "tenant": "default_tenant", "databases": ["default_database"]}
        if parts == ["healthcheck"]:
            return {"is_executor_ready": True, "is_log_client_ready": True}
        if parts == ["reset"] and method == "POST":
            return await self._reset()
        if head != "tenants":
            raise _not_found(f"no route {method} /api/v2/{'/'.join(parts)}")
        if not isinstance(payload, dict):
            raise invalid("the body is a JSON object")
        if len(parts) == 1 and method == "POST":
            name = payload.get("name")
            if not isinstance(name, str) or len(name) < 3:
                raise invalid("a tenant name is at least 3 characters")
            try:
                await self._cat("create_tenant", name)
            except Exists as exc:
                raise ChromaRefusal(409, "UniqueConstraintError", str(exc)) from None
            return {}
        tenant = parts[1]
        if len(parts) == 2 and method == "GET":
            if not await self._cat("tenant", tenant):
                raise _not_found(f"Tenant [{tenant}] not found")
            return {"name": tenant, "resource_name": None}
        if len(parts) < 3 or parts[2] != "databases":
            raise _not_found(f"no route {method} /api/v2/{'/'.join(parts)}")
        return await self._databases(method, tenant, parts[3:], query, payload)

    async def _databases(self, method: str, tenant: str, parts: list[str], query: dict,
                         payload: dict) -> object:
        if not parts:
            if method == "POST":
                name = payload.get("name")
                if not isinstance(name, str) or len(name) < 3:
                    raise invalid("a database name is at least 3 characters")
                if not await self._cat("tenant", tenant):
                    raise _not_found(f"Tenant [{tenant}] not found")
                try:
                    await self._cat("create_database", tenant, name)
                except Exists:
                    raise ChromaRefusal(409, "UniqueConstraintError",
                                        f"Database [{name}] already exists") from None
                return {}
            limit, offset = _paging(query)
            return [{"id": i, "name": n, "tenant": tenant}
                    for i, n in await self._cat("databases", tenant, limit, offset)]
        database = parts[0]
        if len(parts) == 1:
            if method == "GET":
                found = await self._cat("database", tenant, database)
                if found is None:
                    raise _not_found(f"Database [{database}] not found")
                return {"id": found, "name": database, "tenant": tenant}
            if method == "DELETE":
                gone = await self._cat("delete_database", tenant, database)
                if gone is None:
                    raise _not_found(f"Database [{database}] not found")
                for collection in gone:
                    await self._drop_native(collection)
                return {}
        if await self._cat("database", tenant, database) is None:
            raise _not_found(f"Database [{database}] not found")
        if parts[1:] == ["collections_count"]:
            return await self._cat("counted", tenant, database)
        if parts[1] != "collections":
            raise _not_found(f"no route {method} {'/'.join(parts)}")
        rest = parts[2:]
        if not rest:
            if method == "POST":
                return await self._create(tenant, database, payload)
            limit, offset = _paging(query)
            return [await self._model(c) for c in await self._cat("listed", tenant, database, limit, offset)]
        if rest[0] == "by-id" and len(rest) == 2:
            return await self._model(await self._by_id(tenant, database, rest[1]))
        if len(rest) == 1:
            if method == "GET":
                return await self._model(await self._by_name(tenant, database, rest[0]))
            if method == "DELETE":
                found = await self._by_name(tenant, database, rest[0])
                if await self._cat("delete", found.id) is None:
                    raise _collection_missing(rest[0])
                await self._drop_native(found)
                return {}
            if method == "PUT":
                return await self._modify(await self._by_id(tenant, database, rest[0]), payload)
        if len(rest) == 2:
            return await self._records(method, await self._by_id(tenant, database, rest[0]), rest[1], payload)
        raise _not_found(f"no route {method} {'/'.join(parts)}")

    # --- collections
    async def _by_name(self, tenant: str, database: str, name: str) -> ChromaCollection:
        found = await self._cat("named", tenant, database, name)
        if found is None:
            raise _collection_missing(name)
        return found

    async def _by_id(self, tenant: str, database: str, collection_id: str) -> ChromaCollection:
        found = await self._cat("get", collection_id)
        if found is None or found.tenant != tenant or found.database != database:
            raise _collection_missing(collection_id)
        return found

    async def _create(self, tenant: str, database: str, payload: dict) -> dict:
        name = check_name(payload.get("name"))
        metadata = payload.get("metadata")
        if metadata is not None and (not isinstance(metadata, dict) or not metadata):
            raise invalid("Expected metadata to be a non-empty dict")
        configuration = configured(payload.get("configuration"), metadata)
        if payload.get("get_or_create"):
            return await self._model(await self._cat("get_or_create", tenant, database, name, metadata,
                                                     configuration))
        try:
            made = await self._cat("create", tenant, database, name, metadata, configuration)
        except Exists as exc:
            raise ChromaRefusal(409, "UniqueConstraintError", str(exc)) from None
        return await self._model(made)

    async def _modify(self, found: ChromaCollection, payload: dict) -> dict:
        name = payload.get("new_name")
        if name is not None:
            check_name(name)
        metadata = payload.get("new_metadata")
        if metadata is not None and (not isinstance(metadata, dict) or not metadata):
            raise invalid("Expected metadata to be a non-empty dict")
        configuration = None
        new = payload.get("new_configuration")
        if isinstance(new, dict) and isinstance(new.get("hnsw"), dict):
            hnsw = dict(found.configuration.get("hnsw") or HNSW_DEFAULTS)
            hnsw.update({k: v for k, v in new["hnsw"].items() if v is not None and k in HNSW_DEFAULTS
                         and k != "space"})
            configuration = {**found.configuration, "hnsw": hnsw}
        try:
            await self._cat("modify", found.id, name, metadata, configuration)
        except Exists as exc:
            raise ChromaRefusal(409, "UniqueConstraintError", str(exc)) from None
        return {}

    async def _model(self, found: ChromaCollection) -> dict:
        return {"id": found.id, "name": found.name, "configuration_json": found.configuration, "schema": None,
                "metadata": found.metadata, "dimension": await self._dim(found), "tenant": found.tenant,
                "database": found.database, "version": 0, "log_position": 0}

    async def _dim(self, found: ChromaCollection) -> int | None:
        dim = self._dims.get(found.id)
        if dim is None:
            try:
                described = await self.native("GET", found.native, None)
            except ApiError as error:
                if error.status == 404:
                    return None
                raise
            dim = self._dims[found.id] = int(described["dim"])  # type: ignore[index]
        return dim

    async def _drop_native(self, found: ChromaCollection) -> None:
        self._dims.pop(found.id, None)
        try:
            await self.native("DELETE", found.native, None)
        except ApiError as error:
            if error.status != 404:
                raise

    async def _reset(self) -> bool:
        if not self.allow_reset:
            raise ChromaRefusal(403, "AuthorizationError", "Resetting is not allowed by this configuration "
                                                           "(start the server with --arg "
                                                           "chroma_allow_reset=true)")
        for collection in await self._cat("reset"):
            await self._drop_native(collection)
        listed = await self.native("GET", "", None)
        names = [c["name"] for c in listed["collections"]]  # type: ignore[index]
        for name in await self._cat("orphans", names):
            try:
                await self.native("DELETE", name, None)
            except ApiError as error:
                if error.status != 404:
                    raise
        self._dims.clear()
        return True

    # --- records
    def _metric(self, found: ChromaCollection) -> str:
        return str((found.configuration.get("hnsw") or HNSW_DEFAULTS)["space"])

    async def _records(self, method: str, found: ChromaCollection, operation: str, payload: dict) -> object:
        native = found.native

        async def call(verb: str, op: str, body: object) -> object:
            return await self.native(verb, f"{native}/{op}", body)

        records = Records(call, found.name, self._metric(found), await self._dim(found), self.limits,
                          self.sequencer)

        async def create(dim: int) -> None:
            spec = {"name": native, "dim": dim, "metric": self._metric(found), "metadata": P.COLUMNS,
                    "shards": self.shards}
            try:
                await self.native("POST", "", spec)
            except ApiError as error:
                if error.status != 409:  # made by another replica meanwhile: its dimension is checked
                    raise
                self._dims.pop(found.id, None)
                dim_now = await self._dim(found)
                if dim_now != dim:
                    raise invalid(f"Collection expecting embedding with dimension of {dim_now}, "
                                  f"got {dim}") from None
            self._dims[found.id] = dim

        if operation == "count" and method == "GET":
            return await records.count()
        if method != "POST":
            raise _not_found(f"no route {method} {operation}")
        if operation in ("add", "update", "upsert"):
            async with self._locks.setdefault(found.id, asyncio.Lock()):
                await records.write(operation, payload, self.max_batch, create)
            return {}
        if operation == "delete":
            async with self._locks.setdefault(found.id, asyncio.Lock()):
                return {"deleted": await records.delete(payload)}
        if operation == "get":
            return await records.get(payload)
        if operation == "query":
            return await records.query(payload)
        raise _not_found(f"no route {method} {operation}")


def _paging(query: dict) -> tuple[int | None, int]:
    def number(name: str) -> int | None:
        values = query.get(name)
        if not values:
            return None
        try:
            value = int(values[0])
        except ValueError:
            raise invalid(f"{name}: an integer") from None
        if value < 0:
            raise invalid(f"{name}: not negative")
        return value

    return number("limit"), number("offset") or 0
