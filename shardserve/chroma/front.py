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
import contextlib
import fcntl
import functools
import ipaddress
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from urllib.parse import parse_qs, unquote

import numpy as np
import orjson

from shardserve.chroma import points as P
from shardserve.chroma.catalogue import ChromaCatalogue, ChromaCollection, Exists, Missing
from shardserve.chroma.records import ChromaRefusal, Limits, Records, ScanCache, Sequencer, dumps, invalid
from shardserve.query.api import ApiError
from shardserve.query.filters import Among

VERSION = "1.0.0"  # the server version Chroma's 1.5.9 server reports
NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9._-]{1,510}[a-zA-Z0-9]")
HNSW_DEFAULTS = {"space": "l2", "ef_construction": 100, "ef_search": 100, "max_neighbors": 16,
                 "sync_threshold": 1000, "resize_factor": 1.2}
LEGACY_KEYS = {"hnsw:space": "space", "hnsw:construction_ef": "ef_construction",
               "hnsw:search_ef": "ef_search", "hnsw:M": "max_neighbors",
               "hnsw:sync_threshold": "sync_threshold", "hnsw:resize_factor": "resize_factor"}
SPACES = ("l2", "ip", "cosine")
MAX_NAME = 512  # characters of a tenant's or a database's name (a collection's: NAME)
MAX_METADATA_BYTES = 16 * 1024  # a collection's metadata, as JSON
LOCK_WAIT_S = 30.0  # a write waits this long for another replica's write to the same collection
# native call: (method, route, body[, reserved]) where route is "" (the collections) or
# "{name}[/{op}]"; `reserved`: a creation may take a `chroma-<hex>` name (the native API refuses it)
Call = Callable[..., Awaitable[object]]

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

    def __init__(self, root: Path | None, native: Call, limits: Limits, shards: int, allow_reset: bool,
                 max_collections: int, grow_at: int, search: Call | None = None):
        self.root, self.native, self.limits, self.grow_at = root, native, limits, grow_at
        self.search = search  # (native name, matrix, k, among): records.Search on that collection
        self.shards, self.allow_reset, self.max_collections = shards, allow_reset, max_collections
        self._catalogue: ChromaCatalogue | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self.sequencer = Sequencer()
        self.cache = ScanCache()

    async def catalogue(self) -> ChromaCatalogue:
        """The catalogue, opened on first use (off the loop), its orphans dropped then."""
        if self._catalogue is None:
            if self.root is None:
                raise ChromaRefusal(501, "ChromaError", "collections need a local directory "
                                                        "(collections_dir)")
            opened = await asyncio.to_thread(ChromaCatalogue, self.root)
            if self._catalogue is None:
                self._catalogue = opened
                await self._sweep()
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
            status, body, headers = error_body(refusal_of(error))
            if error.retry_after:
                headers["Retry-After"] = str(int(error.retry_after))
            return status, body, headers
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError) as exc:
            # a body of the wrong shape somewhere no check named (orjson's errors are ValueErrors)
            return error_body(invalid(f"the request is not one Chroma's API takes: {type(exc).__name__}: "
                                      f"{str(exc)[:200]}"))

    async def _route(self, method: str, parts: list[str], query: dict, payload: object) -> object:
        if not parts or parts == ["heartbeat"]:
            return {"nanosecond heartbeat": time.time_ns()}
        head = parts[0]
        if parts == ["version"]:
            return VERSION
        if parts == ["pre-flight-checks"]:
            return {"max_batch_size": self.limits.max_batch, "supports_base64_encoding": True}
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
            name = _short_name(payload.get("name"), "tenant")
            try:
                await self._cat("create_tenant", name)
            except Exists as exc:
                raise ChromaRefusal(409, "UniqueConstraintError", str(exc)) from None
            return {}
        if len(parts) == 1:
            raise _not_found(f"no route {method} /api/v2/tenants")
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
                name = _short_name(payload.get("name"), "database")
                try:
                    await self._cat("create_database", tenant, name)
                except Exists as exc:
                    raise ChromaRefusal(409, "UniqueConstraintError", str(exc)) from None
                except Missing as exc:
                    raise _not_found(str(exc)) from None
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
                await self._sweep()
                return {}
        if await self._cat("database", tenant, database) is None:
            raise _not_found(f"Database [{database}] not found")
        if len(parts) == 1:
            raise _not_found(f"no route {method} {'/'.join(parts)}")
        if parts[1:] == ["collections_count"]:
            return await self._cat("counted", tenant, database)
        if parts[1] != "collections":
            raise _not_found(f"no route {method} {'/'.join(parts)}")
        rest = parts[2:]
        if not rest:
            if method == "POST":
                return await self._create(tenant, database, payload)
            limit, offset = _paging(query)
            return [self._model(c) for c in await self._cat("listed", tenant, database, limit, offset)]
        if rest[0] == "by-id" and len(rest) == 2:
            return self._model(await self._by_id(tenant, database, rest[1]))
        if len(rest) == 1:
            if method == "GET":
                return self._model(await self._by_name(tenant, database, rest[0]))
            if method == "DELETE":
                found = await self._by_name(tenant, database, rest[0])
                if await self._cat("delete", found.id) is None:
                    raise _collection_missing(rest[0])
                self._locks.pop(found.id, None)
                await self._sweep()
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
        metadata = _collection_metadata(payload.get("metadata"))
        configuration = configured(payload.get("configuration"), metadata)
        try:
            made = await self._cat("create", tenant, database, name, metadata, configuration,
                                   bool(payload.get("get_or_create")), self.max_collections)
        except Exists as exc:
            raise ChromaRefusal(409, "UniqueConstraintError", str(exc)) from None
        except Missing as exc:
            raise _not_found(str(exc)) from None
        return self._model(made)

    async def _modify(self, found: ChromaCollection, payload: dict) -> dict:
        name = payload.get("new_name")
        if name is not None:
            check_name(name)
        metadata = _collection_metadata(payload.get("new_metadata"))
        configuration = None
        new = payload.get("new_configuration")
        if isinstance(new, dict) and isinstance(new.get("hnsw"), dict):
            hnsw = dict(found.configuration.get("hnsw") or HNSW_DEFAULTS)
            hnsw.update({k: v for k, v in new["hnsw"].items() if v is not None and k in HNSW_DEFAULTS
                         and k != "space"})
            configuration = {**found.configuration, "hnsw": hnsw}
        try:
            if not await self._cat("modify", found.id, name, metadata, configuration):
                raise _collection_missing(found.name)
        except Exists as exc:
            raise ChromaRefusal(409, "UniqueConstraintError", str(exc)) from None
        return {}

    def _model(self, found: ChromaCollection) -> dict:
        return {"id": found.id, "name": found.name, "configuration_json": found.configuration, "schema": None,
                "metadata": found.metadata, "dimension": found.dim, "tenant": found.tenant,
                "database": found.database, "version": 0, "log_position": 0}

    async def _sweep(self) -> None:
        """Drop the native collections of Chroma collections no row names any more (dropped, a
        database or a reset; a first write racing a drop; a process killed between the two)."""
        assert self._catalogue is not None
        listed = await self.native("GET", "", None)
        names = [c["name"] for c in listed["collections"]]  # type: ignore[index]
        for name in await asyncio.to_thread(self._catalogue.orphans, names):
            try:
                await self.native("DELETE", name, None)
            except ApiError as error:
                if error.status != 404:
                    raise
        # their write locks' files: a writer holding one reads the row again under it, finds none
        # and answers 404, whether its file is still there or not (an id is never used again)
        locks = None if self.root is None else self.root / "locks" / "chroma"
        if locks is not None and locks.is_dir():
            for stale in await asyncio.to_thread(self._catalogue.stale, [p.name for p in locks.iterdir()]):
                (locks / stale).unlink(missing_ok=True)

    async def _reset(self) -> bool:
        if not self.allow_reset:
            raise ChromaRefusal(403, "AuthorizationError", "Resetting is not allowed by this configuration "
                                                           "(start the server with --arg "
                                                           "chroma_allow_reset=true)")
        await self._cat("reset")
        self._locks.clear()
        await self._sweep()
        return True

    # --- records
    def _metric(self, found: ChromaCollection) -> str:
        return str((found.configuration.get("hnsw") or HNSW_DEFAULTS)["space"])

    @contextlib.asynccontextmanager
    async def _writing(self, found: ChromaCollection) -> AsyncIterator[ChromaCollection]:
        """The collection's write lock, across the replicas on its node (an flock, polled: a
        cancelled request holds nothing), then its row read again (a 404 if it was deleted
        meanwhile): a write's read, merge and append are one step for every replica."""
        assert self.root is not None
        async with self._locks.setdefault(found.id, asyncio.Lock()):
            locks = self.root / "locks" / "chroma"
            locks.mkdir(parents=True, exist_ok=True)
            handle = os.open(locks / found.id, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                deadline = time.monotonic() + LOCK_WAIT_S
                while True:
                    try:
                        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise ChromaRefusal(503, "ChromaError", f"collection {found.name}: other "
                                                f"writes held it for {LOCK_WAIT_S:g} s; retry") from None
                        await asyncio.sleep(0.002)
                now = await self._cat("get", found.id)
                if now is None:
                    raise _collection_missing(found.name)
                yield now
            finally:
                os.close(handle)  # the flock goes with it

    def _records_of(self, found: ChromaCollection) -> Records:
        async def call(verb: str, op: str, body: object) -> object:
            try:
                return await self.native(verb, f"{found.native}/{op}", body)
            except ApiError as error:
                if error.status == 404:  # deleted meanwhile: Chroma's words for it
                    raise _collection_missing(found.name) from None
                raise

        async def search(matrix: np.ndarray, k: int, among: Among | None
                         ) -> tuple[np.ndarray, np.ndarray] | None:
            assert self.search is not None
            try:
                return await self.search(found.native, matrix, k, among)  # type: ignore[return-value]
            except ApiError as error:
                if error.status == 404:
                    raise _collection_missing(found.name) from None
                raise

        return Records(call, found.name, self._metric(found), found.dim, self.limits, self.sequencer,
                       self.cache, found.native, None if self.search is None else search)

    async def _created(self, found: ChromaCollection, dim: int) -> None:
        """The native collection of `found`'s first write (under its write lock), its dimension
        recorded; a collection deleted meanwhile loses it again (and is a 404)."""
        spec = {"name": found.native, "dim": dim, "metric": self._metric(found), "metadata": P.COLUMNS,
                "shards": self.shards, "grow_at": self.grow_at}
        try:
            await self.native("POST", "", spec, True)
        except ApiError as error:
            if error.status != 409:
                raise
            try:  # made before, by a write whose row update was lost to a kill: its dimension rules
                described = await self.native("GET", found.native, None)
            except ApiError:
                raise error from None  # not made: the server is full (its 409, as it said it)
            if int(described["dim"]) != dim:  # type: ignore[index]
                raise invalid(f"Collection expecting embedding with dimension of {described['dim']}, "  # type: ignore[index]
                              f"got {dim}") from None
        if not await self._cat("set_dim", found.id, dim):
            await self._sweep()
            raise _collection_missing(found.name)

    async def _records(self, method: str, found: ChromaCollection, operation: str, payload: dict) -> object:
        if operation == "count" and method == "GET":
            return await self._records_of(found).count()
        if method != "POST":
            raise _not_found(f"no route {method} {operation}")
        if operation in ("add", "update", "upsert", "delete"):
            async with self._writing(found) as now:
                records = self._records_of(now)
                if operation == "delete":
                    return {"deleted": await records.delete(payload)}
                await records.write(operation, payload, functools.partial(self._created, now))
            return {}
        if operation == "get":
            return await self._records_of(found).get(payload)
        if operation == "query":
            return await self._records_of(found).query(payload)
        raise _not_found(f"no route {method} {operation}")


def _short_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not 3 <= len(name) <= MAX_NAME:
        raise invalid(f"a {what} name is 3 to {MAX_NAME} characters")
    return name


def _collection_metadata(metadata: object) -> dict | None:
    """A collection's metadata: null, or a non-empty object of scalars within MAX_METADATA_BYTES."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not metadata:
        raise invalid("Expected metadata to be a non-empty dict")
    for key, value in metadata.items():
        if not isinstance(value, (str, int, float, bool)) and value is not None:
            raise invalid(f"metadata {str(key)[:40]!r}: a string, number or boolean")
    if len(orjson.dumps(metadata)) > MAX_METADATA_BYTES:
        raise invalid(f"a collection's metadata is at most {MAX_METADATA_BYTES} bytes as JSON")
    return metadata


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
