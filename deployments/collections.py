"""Collections in the router: `/v1/collections` (create, list, describe, drop) and each
collection's own search, writes and point API under `/v1/collections/{name}/`.

A collection is an index directory like any (index_build.empty makes it, empty and flat), under the
collections directory, named in its catalogue (shardserve.collection.catalogue). Creating one
starts no process and deploys no application: every router replica answers it itself, holding its
(small) index and following its write log as a shard replica does (shardserve.writes.follow), so a
200 to a write is visible to the next request through any replica. Its exact searches run in the
router's search thread (FAISS releases the GIL), never on the event loop. A replica holds at most
`max_collections_held` collections (the least recently used are let go, and loaded again from disk
when asked); a dropped one is let go at its next request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import resource
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import orjson
from pydantic import ValidationError

from deployments.collection_apps import apart_app
from deployments.config import AppArgs
from index_build.empty import create_empty
from index_build.grow import grown
from shardserve.chroma.catalogue import NATIVE
from shardserve.collection.catalogue import Catalogue, Entry, NameTaken
from shardserve.collection.spec import CollectionSpec
from shardserve.errors import ShardserveError
from shardserve.index.manifest import Manifest, Published, read_manifest, read_shard_checked
from shardserve.index.metadata import combine
from shardserve.index.storage import Location
from shardserve.query.api import ApiError, Limits, ParsedQuery
from shardserve.query.filters import Among
from shardserve.query.merge import QueryResult, merge_topk
from shardserve.query.parse import _checked, is_npy, parse_query
from shardserve.query.render import render_search, windowed
from shardserve.query.searcher import ShardSearcher
from shardserve.runtime.fair import Busy, FairExecutor
from shardserve.transport.http_front import Reply
from shardserve.transport.http_front import Request as HttpRequest
from shardserve.transport.http_front import json_reply as _json
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.accept import WriteFront, delete_matching
from shardserve.writes.delta import MAX_DELTA_ROWS
from shardserve.writes.follow import LogBehind, ShardWrites
from shardserve.writes.log import log_path
from shardserve.writes.parse import delete_filter
from shardserve.writes.points import (
    PointsQuery,
    page,
    parse_count,
    parse_points,
    parse_scroll,
    picked,
    rendered,
)
from shardserve.writes.redis_log import LogUnavailable
from shardserve.writes.roll import gathered

logger = logging.getLogger("ray.serve")

ROUTE = re.compile(r"/v1/collections(?:/([^/]+)(?:/([a-z]+))?)?")
OPERATIONS = frozenset({"search", "upsert", "delete", "points", "count", "scroll"})


APP_MISSING_S = 5.0  # an application serving a collection apart not found: asked for again after this


def default_root(index: str) -> Path | None:
    """Where `shardserve serve DIR` keeps its collections: DIR/collections, for an index on a local
    disk (None otherwise: they need a local disk, as the write log does)."""
    log = log_path(index)
    return None if log is None else log.parent.parent / "collections"


@dataclass
class Held:
    """A collection a router replica answers: its catalogue entry, its published version, each of
    its shards' index and writes as a shard replica follows them, and its write front."""

    entry: Entry
    manifest: Manifest
    shards: list[ShardWrites]
    front: WriteFront
    log: Path
    # the manifest requests are checked against: its shards counted at the rows the collection may
    # hold (a filter's work bound: comparisons x rows), not the base's alone
    checks: Manifest
    stamp: tuple[int, int]  # manifest.json's (inode, mtime) when loaded: a new version replaces it

    def catch_up(self) -> None:
        for shard in self.shards:
            shard.catch_up()

    def count(self) -> int:
        if len(self.shards) == 1:
            self.shards[0].catch_up()
            return self.shards[0].live_rows()
        # distinct ids: an overwrite moving an id between shards, applied by one shard and not yet by
        # the other, is not counted twice
        return len(np.unique(np.concatenate([shard.live_ids()[0] for shard in self.shards])))

    def counted(self) -> tuple[int, int]:
        """(count, the log position it is the count at): what a reader keys a cache of the
        collection on (no write has been acknowledged past it)."""
        count = self.count()
        return count, max(shard.position for shard in self.shards)

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


def _stamp(path: Path) -> tuple[int, int]:
    """manifest.json's identity: a fold publishes by replacing it (a new inode)."""
    try:
        found = os.stat(path / "manifest.json")
    except OSError:
        return (0, 0)  # dropped meanwhile: its load answers 404
    return found.st_ino, found.st_mtime_ns


class CollectionsFront:
    """One router replica's collections (`respond` answers every /v1/collections route)."""

    def __init__(self, root: Path | None, args: AppArgs, limits: Limits):
        self.root, self.args, self.limits = root, args, limits
        # their own threads: a collection's scan or read never queues in front of the index's work
        # Each collection's reads queue on their own and the threads take them in turn, one call of
        # a collection at a time: a flood on one waits behind itself, not in front of the others,
        # and holds one thread (shardserve.runtime.fair).
        self.executor = FairExecutor("collections", args.max_collection_waiting,
                                     lambda: faiss.omp_set_num_threads(1), workers=args.collection_threads)
        self._writes_thread = ThreadPoolExecutor(1, "collection-writes")  # shared by every collection
        self._catalogue: Catalogue | None = None
        self._held: OrderedDict[int, Held] = OrderedDict()
        self._named: dict[str, int] = {}  # the id held under each name
        self._loading: dict[int, asyncio.Future] = {}  # one load per collection, whoever asks first
        self._apps: dict[str, Any] = {}  # handles of the applications serving collections apart
        self._missing_until: dict[str, float] = {}  # applications not found: not asked again until then
        self._forwarding: dict[int, int] = {}  # requests forwarded and not answered yet, per collection
        self.max_held = held_within_files(args.max_collections_held)

    async def catalogue(self) -> Catalogue:
        """The catalogue, opened (and recovered) on first use, off the event loop."""
        if self._catalogue is None:
            if self.root is None:
                raise ApiError(501, None, "collections need a local directory: the index is on remote "
                                          "storage (set the app argument collections_dir)")
            try:
                opened = await asyncio.to_thread(Catalogue, self.root)
            except (OSError, sqlite3.Error) as exc:
                raise ApiError(501, None, f"collections directory {self.root} is not writable ({exc}): "
                                          "set the app argument collections_dir") from None
            if self._catalogue is None:
                self._catalogue = opened
            else:  # another request opened it meanwhile
                opened.close()
        return self._catalogue

    async def _read(self, function: Callable, *args: object):
        """A catalogue read or change, off the event loop (SQLite may wait for another writer's lock)."""
        catalogue = await self.catalogue()
        return await asyncio.to_thread(getattr(catalogue, function.__name__), *args)

    async def respond(self, request: HttpRequest, route: str, reserved: bool = False) -> Reply:
        """Every /v1/collections route. `reserved`: a creation may take a name Chroma's collections
        keep for themselves (`chroma-<32 hex>`: only Chroma's API, in-process, passes it)."""
        match = ROUTE.fullmatch(route)
        if match is None:
            return _json({"error": f"no route {request.method} {route}", "field": None}, 404)
        name, operation = match[1], match[2]
        method = request.method
        if name is None:
            if method == "POST":
                return await self._create(request.body, reserved)
            if method == "GET":
                return _json({"collections": [_described(e) for e in await self._read(Catalogue.live)]})
        elif operation is None:
            if method == "GET":
                entry = await self._entry(name)
                served = await self._forwarded(entry, request, "index", b"", "GET")
                counted = None if served is None else await self._forwarded(entry, request, "count", b"{}")
                for reply in (served, counted):
                    if reply is not None and reply.status != 200:
                        return reply  # its refusal (an overload's 503), as it gave it
                if served is not None and counted is not None:  # served apart: the version it serves
                    version = orjson.loads(served.body)["index_version"]
                    manifest = await asyncio.to_thread(read_manifest, Location.parse(str(entry.path)))
                    return _json({**_described(entry), **_stage(manifest), "version": version,
                                  "served_by": apart_app(entry.path),
                                  "count": orjson.loads(counted.body)["count"]})
                held = await self._held_named(name, entry)
                return _json({**_described(held.entry), **_stage(held.manifest), "served_by": None,
                              "count": await self._run(held, held.count)})
            if method == "DELETE":
                return await self._drop(name)
        elif method == "POST" and operation in OPERATIONS:
            entry = await self._entry(name)
            forwarded = await self._forwarded(entry, request, operation, request.body)
            if forwarded is not None:
                return forwarded
            held = await self._held_named(name, entry)
            try:
                return await getattr(self, f"_{operation}")(held, request)
            except (LogBehind, LogUnavailable) as exc:
                raise ApiError(503, None, f"collection {name!r} is catching up with its log: {exc}",
                               self.args.retry_after_s) from None
        return _json({"error": f"no route {method} {route}", "field": None}, 404)

    async def _create(self, body: bytes, reserved: bool = False) -> Reply:
        try:
            spec = CollectionSpec.model_validate_json(body or b"{}")
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(str(part) for part in error["loc"]) or "body"
            raise ApiError(422, field, f"{field}: {error['msg']}") from None
        if NATIVE.fullmatch(spec.name) and not reserved:
            raise ApiError(422, "name", "names chroma-<32 hex digits> are kept for the collections of "
                                        "Chroma's API")
        catalogue = await self.catalogue()
        if len(await self._read(Catalogue.live)) >= self.args.max_collections:
            raise ApiError(409, None, f"this server holds its maximum of {self.args.max_collections} "
                                      "collections (max_collections): drop one first")
        try:
            entry = await asyncio.to_thread(catalogue.create, spec, create_empty)
        except NameTaken as exc:
            raise ApiError(409, "name", str(exc)) from None
        except OSError as exc:  # nothing of it is left (Catalogue.create)
            raise ApiError(507, None, f"the collection could not be written: {exc.strerror or exc}") from None
        return _json(_described(entry), 201)

    async def _drop(self, name: str) -> Reply:
        entry = await self._read(Catalogue.drop, name)
        if entry is None:
            raise _missing(name)
        self._let_go(entry.id)
        return _json({"dropped": name, "id": entry.id})

    async def _entry(self, name: str) -> Entry:
        entry = await self._read(Catalogue.get, name)
        if entry is None:
            self._let_go_named(name)
            raise _missing(name)
        return entry

    def _let_go_named(self, name: str) -> None:
        stale = self._named.get(name)
        if stale is not None:
            self._let_go(stale)

    async def _forwarded(self, entry: Entry, request: HttpRequest, operation: str, body: bytes,
                         method: str = "POST") -> Reply | None:
        """The collection's answer from the application serving it apart
        (deployments.collection_apps), or None: it is not served apart, or that application is
        not there (the server restarted: this replica answers it until the folder deploys it again)."""
        app = apart_app(entry.path)
        if app is None or time.monotonic() < self._missing_until.get(app, 0.0):
            return None
        handle = self._apps.get(app)
        if handle is None:
            try:
                from ray import serve

                # a call to Serve's controller: off the event loop
                handle = self._apps[app] = await asyncio.to_thread(serve.get_app_handle, app)
            except Exception as exc:  # noqa: BLE001 (no such application now: answered here)
                self._missing_until[app] = time.monotonic() + APP_MISSING_S  # asked again later
                logger.info("collection %s: no application %s (%r): answered here", entry.name, app, exc)
                return None
        kept = self._held.get(entry.id)
        if kept is not None and not kept.front.waiting:
            self._let_go(entry.id)  # not answered here any more
        if self._forwarding.get(entry.id, 0) >= self.args.max_collection_waiting:
            raise ApiError(503, None, f"collection {entry.name!r} is overloaded: "
                                      f"{self.args.max_collection_waiting} of its requests wait",
                           self.args.retry_after_s)
        routed = HttpRequest(method, f"/v1/{operation}", body, request.query, request.content_type,
                             request.lane, request.traceparent)
        self._forwarding[entry.id] = self._forwarding.get(entry.id, 0) + 1
        try:
            return await handle.respond.remote(routed, "")
        except Exception as exc:  # noqa: BLE001 (sorted below)
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, ApiError):  # its answer: a refusal, as the client sent it
                raise ApiError(cause.status, cause.field, cause.message, cause.retry_after) from None
            self._apps.pop(app, None)  # asked for again at the next request
            # a write may be applied already, a read may be answered by now: the client retries
            raise ApiError(503, None, f"collection {entry.name!r}: its application did not answer "
                                      f"({type(cause).__name__}); retry", self.args.retry_after_s) from None
        finally:
            self._forwarding[entry.id] -= 1

    async def _held_named(self, name: str, entry: Entry | None = None) -> Held:
        """The live collection `name`, loaded in this replica (a 404 when there is none; a copy of
        a dropped one of that name, loaded before, is let go here)."""
        entry = entry or await self._read(Catalogue.get, name)
        stale = self._named.get(name)
        if stale is not None and (entry is None or stale != entry.id):
            self._let_go(stale)  # a dropped one of that name, loaded before
        if entry is None:
            raise _missing(name)
        held = self._held.get(entry.id)
        if held is None or held.stamp != _stamp(entry.path):  # not held, or a fold published anew
            loaded = await self._loaded(entry, held)
            current = self._held.get(entry.id)
            if current is not loaded:  # not installed yet by another request that awaited it
                # The version it replaces is not closed here: a request that took it before may
                # still read it (a closed one would open its log again, and keep it open). Its
                # last reference dropped, its log connections close with it.
                self._held[entry.id] = loaded
                self._named[name] = entry.id
            self._within_budget(entry.id)
        self._held.move_to_end(entry.id)
        return self._held[entry.id]

    def _within_budget(self, keep: int) -> None:
        """Let go of the least recently used collections with no write waiting until the shards
        held (each keeps its own log reader open) are within `max_held`."""
        held = sum(len(kept.shards) for kept in self._held.values())
        for collection_id, kept in list(self._held.items()):
            if held <= self.max_held:
                return
            if collection_id != keep and not kept.front.waiting:
                held -= len(kept.shards)
                self._let_go(collection_id)

    async def _loaded(self, entry: Entry, previous: Held | None) -> Held:
        """`entry`'s published version loaded in a thread, once, whoever asks for it meanwhile
        (keeping `previous`'s write front, when a new version replaces it); a 404 if it was
        dropped while it loaded: its files gone."""
        loading = self._loading.get(entry.id)
        if loading is None:
            front = None if previous is None else previous.front
            loading = asyncio.ensure_future(asyncio.to_thread(self._load, entry, front))
            self._loading[entry.id] = loading
            loading.add_done_callback(lambda _: self._loading.pop(entry.id, None))
        try:
            return await asyncio.shield(loading)
        except (OSError, ShardserveError) as exc:
            logger.info("collection %s did not load: %r", entry.name, exc)
            if previous is not None:  # it was there: a version replaced again while it loaded
                raise ApiError(503, None, f"collection {entry.name!r} is moving to a new version",
                               self.args.retry_after_s) from None
            raise _missing(entry.name) from None

    def _load(self, entry: Entry, front: WriteFront | None) -> Held:
        stamp = _stamp(entry.path)
        published = Published.open(str(entry.path))
        manifest, location = published.manifest, published.version
        log = entry.path / "writes" / "log.sqlite"
        trained = manifest.trained
        shards: list[ShardWrites] = []
        try:
            for shard in range(len(manifest.shards)):
                searcher = ShardSearcher.load(location, manifest, shard, mmap=True)
                shards.append(ShardWrites(searcher, shard, len(manifest.shards), log, manifest.log_position,
                                          lambda: read_shard_checked(location, trained) if trained else None))
                shards[-1].catch_up(True)
        except BaseException:
            for opened in shards:
                opened.close()
            raise
        if front is None:
            front = WriteFront(log, self.args.max_write_points, retry_after_s=self.args.retry_after_s,
                               thread=self._writes_thread, create_log=False)
        bounded = [entry_.model_copy(update={"num_vectors": entry_.num_vectors + MAX_DELTA_ROWS})
                   for entry_ in manifest.shards]
        return Held(entry, manifest, shards, front, log, manifest.model_copy(update={"shards": bounded}),
                    stamp)

    def _let_go(self, collection_id: int) -> None:
        held = self._held.pop(collection_id, None)
        if held is not None:
            if self._named.get(held.entry.name) == collection_id:
                del self._named[held.entry.name]
            held.front.close()
            held.close()

    def _served(self, held: Held) -> Callable[[], tuple[Manifest, Path]]:
        """`served` for a write: a 404 (nothing written) when the collection was dropped meanwhile."""
        def served() -> tuple[Manifest, Path]:  # in the writes thread
            assert self._catalogue is not None
            entry = self._catalogue.get(held.entry.name)
            if entry is None or entry.id != held.entry.id:
                raise _missing(held.entry.name)
            return held.manifest, held.log
        return served

    async def _search(self, held: Held, request: HttpRequest) -> Reply:
        started = time.perf_counter()
        query = parse_query(request, held.checks, frozenset(), self.limits)
        result = windowed(query, await self._answer(held, query), held.manifest.metric != "l2")
        metadata = None
        if query.include:
            columns, metadata = list(query.include), []
            for ids in result.ids:
                wanted = [int(i) for i in ids[ids >= 0]]
                rows = combine(await self._run(held, _lookups, held.shards, wanted, columns), len(wanted))
                metadata.append([row or {} for row in rows])
        body = render_search(query, result, (time.perf_counter() - started) * 1000.0,
                             held.manifest.index_version, metadata)
        return Reply(200, body)

    async def _answer(self, held: Held, query: ParsedQuery) -> QueryResult:
        params: dict = dict(query.params)
        if query.filter is not None:
            params["filter"] = query.filter
        return await self._fanned(held, ShardQuery(query.matrix, query.k, params))

    async def search_among(self, name: str, matrix: np.ndarray, k: int, among: Among | None
                           ) -> tuple[np.ndarray, np.ndarray] | None:
        """In-process, for Chroma's API (which checked the batch against the collection and its
        bounds): (distances, ids) of the k nearest of each row of `matrix` in collection `name`,
        among the ids of `among` (None: all). None when the collection is served apart: the caller
        asks its routes, which forward. The ids go to the shards as they are, no JSON between."""
        entry = await self._entry(name)
        if apart_app(entry.path) is not None:
            return None
        held = await self._held_named(name, entry)
        # the native search's own checks of a batch: its dim, finite in float32, no overflowing norm,
        # no zero row under cosine (a 422, as through the routes)
        checked = _checked(np.ascontiguousarray(matrix, np.float32), "query_embeddings", held.manifest.dim,
                           held.manifest.metric)
        params = {} if among is None else {"filter": among}
        try:
            result = await self._fanned(held, ShardQuery(checked, k, params))
        except (LogBehind, LogUnavailable) as exc:
            raise ApiError(503, None, f"collection {name!r} is catching up with its log: {exc}",
                           self.args.retry_after_s) from None
        return result.distances, result.ids

    async def _fanned(self, held: Held, shard_query: ShardQuery) -> QueryResult:
        """A batch answered by every shard of the collection, merged."""
        answers = await self._run(held, lambda: [shard.answer(shard_query) for shard in held.shards])
        if len(answers) == 1:
            distances, ids, ms, matched, _ = answers[0]
            return QueryResult(distances, ids, 1, 1, ms, ms, 1, matched=matched)
        distances, ids = merge_topk([a[0] for a in answers], [a[1] for a in answers], shard_query.k,
                                    held.manifest.metric != "l2", positions=[a[4] for a in answers])
        ms = sum(a[2] for a in answers)
        return QueryResult(distances, ids, len(answers), len(answers), ms, ms, 1,
                           matched=sum(int(a[3]) for a in answers))

    async def _upsert(self, held: Held, request: HttpRequest) -> Reply:
        return _json(await held.front.accept(request.body, True, held.manifest, held.log,
                                             served=self._served(held), npy=is_npy(request.content_type)))

    async def _delete(self, held: Held, request: HttpRequest) -> Reply:
        npy = is_npy(request.content_type)  # ids as a .npy array
        kinds = held.manifest.dataset.metadata_kinds
        where = None if npy else delete_filter(request.body, kinds, MAX_DELTA_ROWS)
        if where is None:
            return _json(await held.front.accept(request.body, False, held.manifest, held.log,
                                                 served=self._served(held), npy=npy))

        async def evaluate():
            limit = self.limits.max_filter_delete_points

            def matching() -> list:
                found = []
                for shard in held.shards:
                    ids, count, position = shard.ids_matching(where, limit)
                    metadata = shard.searcher.metadata
                    found.append((ids, count, position, None if metadata is None else metadata.table.schema))
                return found

            return gathered(await self._run(held, matching), limit), held.manifest, held.log, where

        return _json(await delete_matching(held.front, evaluate, served=self._served(held)))

    async def _points(self, held: Held, request: HttpRequest) -> Reply:
        query = parse_points(request.body, held.checks, self.limits.max_page)
        return _json({"points": await self._get(held, query)})

    async def _get(self, held: Held, query: PointsQuery) -> list[dict]:
        ids = list(query.ids)
        columns = list(query.include)
        answers = await self._run(held, lambda: [s.points(ids, columns, query.vectors) for s in held.shards])
        found, vectors = picked(answers, len(ids))
        return rendered(ids, found, vectors, query.vectors)

    async def _count(self, held: Held, request: HttpRequest) -> Reply:
        where = parse_count(request.body, held.checks)
        if where is None:
            count, position = await self._run(held, held.counted)
            return _json({"count": count, "position": position})
        found = await self._run(held, lambda: [shard.live_ids(where)[0] for shard in held.shards])
        return _json({"count": len(np.unique(np.concatenate(found)))})

    async def _scroll(self, held: Held, request: HttpRequest) -> Reply:
        query = parse_scroll(request.body, held.checks, self.limits.max_page)
        found = await self._run(held, lambda: [shard.page(query.after, query.limit + 1, query.filter)
                                         for shard in held.shards])
        ids, more = page(found, query.limit)
        points = (await self._get(held, PointsQuery(tuple(ids.tolist()), query.include, query.vectors))
                  if len(ids) else [])
        return _json({"points": points, "next": int(ids[-1]) if more else None})

    async def _run(self, held: Held, function: Callable, *args: object):
        """A blocking read of a collection (a search, its log read, a pass over its ids) off the
        event loop, on the collections' thread, in turn with the other collections' (a 503 when
        `max_collection_waiting` of this one's wait already)."""
        try:
            future = self.executor.submit(held.entry.id, function, *args)
        except Busy:
            raise ApiError(503, None, f"collection {held.entry.name!r} is overloaded: "
                                      f"{self.executor.max_waiting} of its requests wait",
                           self.args.retry_after_s) from None
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self.executor.shutdown()  # first: no read starts on a collection being let go below
        for collection_id in list(self._held):
            self._let_go(collection_id)
        self._writes_thread.shutdown(wait=False)
        if self._catalogue is not None:
            self._catalogue.close()


FILES_PER_HELD = 8  # a held shard's open files: two SQLite connections (writer, reader) and their WAL
FILES_KEPT = 512  # left for everything else of the replica (sockets, the index's files, Ray's)


def held_within_files(wanted: int) -> int:
    """`wanted`, or fewer when this process may not open that many files (RLIMIT_NOFILE): a held
    collection keeps its logs open, and a replica out of file descriptors fails every request."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - FILES_KEPT) // FILES_PER_HELD))


def _lookups(shards: list[ShardWrites], ids: list[int], columns: list[str]) -> list[list[dict | None]]:
    return [shard.lookup(ids, columns) for shard in shards]


def _described(entry: Entry) -> dict:
    return {"name": entry.name, "id": entry.id, "created_at": entry.created,
            **entry.spec.model_dump(exclude={"name"})}


def _stage(manifest: Manifest) -> dict:
    """Where a collection is in its growth: `exact` (one flat index, searched whole) or `built` (its
    spec's index, with the search setting its gate chose), and its version."""
    built = grown(manifest)
    return {"stage": "built" if built else "exact", "version": manifest.index_version,
            "built_as": manifest.index_factory if built else None,
            "search_params": manifest.build.params.get("search_params", {}) if built else {}}


def _missing(name: str) -> ApiError:
    return ApiError(404, None, f"no collection named {name!r}")



