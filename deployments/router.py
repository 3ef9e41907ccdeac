"""Router ingress: HTTP API, batching of in-flight queries, one call per shard per batch, merge.

Thin by design: parsing lives in core.api, fan-out and merge in core.fanout / core.merge.
"""


import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import faiss
import numpy as np
import orjson
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from core.api import ApiError, ParsedQuery, check_work, hits, parse_search_request, read_body
from core.batcher import AdaptiveBatcher
from core.fanout import QueryResult, plain_query, search_batch
from core.indexes import prepare_vectors, supported_params
from core.manifest import Manifest, read_manifest
from core.openapi import docs_page, openapi_document
from core.ray_private import deployment_handle_unchecked
from core.searcher import CoarseAssigner
from core.shard_link import ShardLinks
from core.shard_wire import ShardQuery, decode_answer
from core.storage import Location
from deployments.config import INDEX_INGRESS, AppArgs, index_app_name
from deployments.metrics import RouterMetrics
from deployments.shard_calls import call_shard, shard_handle

_JSON = "application/json"
LINK_REFRESH_S = 1.0  # how soon a router uses a new shard replica's link (Serve calls meanwhile)
logger = logging.getLogger("ray.serve")


def _json(payload: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type=_JSON, headers=headers)


def _error_response(error: ApiError) -> Response:
    headers = {"Retry-After": str(int(error.retry_after))} if error.retry_after else None
    return Response(error.body(), status_code=error.status, media_type=_JSON, headers=headers)


@dataclass(frozen=True)
class IndexSet:
    """One index version as the router sees it: a request is answered by exactly one of these."""

    generation: int
    app: str
    manifest: Manifest
    shards: list[DeploymentHandle]  # with the shard-call options (deployments.shard_calls)
    supported: frozenset[str]
    assigner: CoarseAssigner | None  # IVF: the coarse quantizer, run once per batch here
    links: ShardLinks | None  # a TCP link per shard replica (None: Serve handle calls only)
    directory: DeploymentHandle  # the version's ingress: where each shard replica listens

    @classmethod
    async def load(cls, generation: int, index: str, app: str, use_links: bool) -> "IndexSet":
        """Files are read in a thread; handles are made on the replica's event loop (Serve's
        throughput-optimised handles refuse to be set up outside it)."""
        manifest, assigner, supported = await asyncio.to_thread(cls._read, index)
        shards = [shard_handle(deployment_handle_unchecked(s.name, app)) for s in manifest.shards]
        directory = deployment_handle_unchecked(INDEX_INGRESS, app)
        loaded = cls(generation, app, manifest, shards, supported, assigner,
                     ShardLinks(len(shards)) if use_links else None, directory)
        await loaded.refresh_links(timeout_s=2.0)
        return loaded

    async def refresh_links(self, timeout_s: float = 5.0) -> None:
        """Follow the directory (replicas started, moved or gone). Best effort: a shard without a
        link is called through Serve."""
        if self.links is None:
            return
        try:
            endpoints = await asyncio.wait_for(self.directory.endpoints.remote(), timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.info("shard link directory of %s not reachable: %s", self.app, exc)
            return
        self.links.update(endpoints)

    async def call(self, shard: int, query: ShardQuery) -> tuple[np.ndarray, np.ndarray, float]:
        """One shard call: over the shard's link when one is up, else (or if it breaks) Serve."""
        link = self.links.pick(shard) if self.links is not None else None
        if link is not None:
            try:
                return decode_answer(await link.call(query.encode()))
            except ConnectionError:
                self.links.drop(shard, link)
        return await call_shard(self.shards[shard], query)

    @staticmethod
    def _read(index: str) -> tuple[Manifest, CoarseAssigner | None, frozenset[str]]:
        location = Location.parse(index)
        manifest = read_manifest(location)
        return (manifest, CoarseAssigner.load(location, manifest),
                frozenset(supported_params(manifest.index_factory, manifest.dim, manifest.metric)))


@serve.deployment(max_ongoing_requests=512)
class Router:
    """Plain ASGI-request ingress (no per-request FastAPI stack): exact routes under its prefix."""

    async def __init__(self, control: DeploymentHandle, args: dict):  # Serve awaits async constructors
        self.args = AppArgs.model_validate(args)
        self.control = control
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.use_links = self.args.shard_transport == "link"
        # A replica started after a swap (restart, scale-up) must serve the current version, not the
        # config's: ask the pointer first; the config's index only if it does not answer.
        try:
            pointer = await asyncio.wait_for(self.control.poll.remote(self.replica_id, -1, 0), 10.0)
            self.active = await IndexSet.load(pointer["generation"], pointer["index"], pointer["app"],
                                              self.use_links)
        except Exception as exc:
            logger.warning("index pointer not reachable (%s): serving the configured index", exc)
            self.active = await IndexSet.load(0, self.args.index, index_app_name(context.app_name),
                                              self.use_links)
        self.in_flight_by_generation: Counter[int] = Counter()
        self.metrics = RouterMetrics()
        self.metrics.shard_names = [s.name for s in self.active.manifest.shards]
        self.metrics.index_generation.set(self.active.generation)  # not only after a swap
        self.in_flight = 0
        self.openapi = orjson.dumps(openapi_document())
        # The coarse quantizer runs here, off the event loop, one OpenMP thread (as in the shards).
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantizer",
                                           initializer=faiss.omp_set_num_threads, initargs=(1,))
        self.batcher = AdaptiveBatcher(self._search_batch, self.args.max_batch_size,
                                       self.args.max_concurrent_batches,
                                       size_of=lambda item: len(item[1].matrix))
        loop = asyncio.get_running_loop()
        self._poller = loop.create_task(self._follow_pointer())
        self._link_follower = loop.create_task(self._follow_links()) if self.use_links else None

    async def __call__(self, request: Request) -> Response:
        # Serve puts the route prefix in root_path; match the rest exactly.
        root = request.scope.get("root_path", "")
        route = request.scope.get("path", "")[len(root):].rstrip("/") or "/"
        method = request.method
        if route == "/v1/search" and method == "POST":
            return await self.search(request)
        if method == "GET":
            if route == "/v1/health":
                return await self.health()
            if route == "/v1/index":
                return self.index()
            if route == "/openapi.json":
                return Response(self.openapi, media_type=_JSON)
            if route == "/docs":
                return Response(docs_page(f"{root}/openapi.json"), media_type="text/html")
        return _json({"error": f"no route {method} {route}", "field": None}, 404)

    # --- HTTP endpoints ---------------------------------------------------------------------------

    async def search(self, request: Request) -> Response:
        """k nearest neighbours of one vector (`vector`) or of a batch (`vectors`)."""
        started = time.perf_counter()
        try:  # the body first, bounded in size and time: an upload holds no admission slot
            body = await self._read_body(request)
        except ApiError as error:
            return self._refused(error, started)
        if self.in_flight >= self.args.max_in_flight:  # shed before any parsing: fast 503
            self.metrics.shed.inc()
            return self._refused(ApiError(503, None, f"overloaded: {self.in_flight} requests in flight",
                                          self.args.retry_after_s), started)
        self.in_flight += 1
        index_set = self.active  # this request is answered by this version only, even mid-swap
        self.in_flight_by_generation[index_set.generation] += 1
        status = 200
        try:
            query = self._parse(body, index_set)
            result = await self.batcher.submit((index_set, query))
            self._check_coverage(query, result)
            return Response(self._render(query, result, started, index_set), media_type=_JSON)
        except ApiError as error:
            status = error.status
            return _error_response(error)
        except BaseException:
            status = 500
            raise
        finally:
            self.in_flight -= 1
            self.in_flight_by_generation[index_set.generation] -= 1
            self.metrics.request_ms.observe((time.perf_counter() - started) * 1000.0,
                                            tags={"endpoint": "search", "status": str(status)})

    def _refused(self, error: ApiError, started: float) -> Response:
        self.metrics.request_ms.observe((time.perf_counter() - started) * 1000.0,
                                        tags={"endpoint": "search", "status": str(error.status)})
        return _error_response(error)

    async def health(self) -> Response:
        """200 when every shard of the served index answers, else 503 with Retry-After."""
        index_set = self.active
        try:
            infos = await asyncio.wait_for(
                asyncio.gather(*[shard.info.remote() for shard in index_set.shards]), 5.0)
        except Exception as exc:  # a shard not (yet) up: not ready
            return _error_response(ApiError(503, None, f"not ready: {type(exc).__name__}",
                                            self.args.retry_after_s))
        # Replicas reached over a shard link, per shard (0: that shard is called through Serve).
        links = index_set.links.count() if index_set.links is not None else [0] * len(infos)
        return _json({"status": "ok", "shards": len(infos), "index": index_set.manifest.index_version,
                      "links": links})

    def index(self) -> Response:
        """Summary of the manifest being served and the request limits."""
        m = self.active.manifest
        return _json({
            "index_version": m.index_version, "index_factory": m.index_factory, "dim": m.dim,
            "metric": m.metric, "num_vectors": m.num_vectors, "dataset": m.dataset.model_dump(),
            "created_at": m.created_at,
            "shards": [{"name": s.name, "num_vectors": s.num_vectors, "bytes": s.bytes} for s in m.shards],
            "params": sorted(self.active.supported), "max_k": self.args.max_k,
            "max_vectors": self.args.max_vectors, "max_body_bytes": self.args.max_body_bytes,
            "max_work": self.args.max_work,
        })

    # --- internals --------------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """413 past max_body_bytes (declared, or counted while streaming), 408 past body_timeout_s."""
        limit = self.args.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, "body", f"body of {declared} bytes exceeds {limit}")
        try:  # asyncio.timeout: a timer, not a task per request as wait_for would create
            async with asyncio.timeout(self.args.body_timeout_s):
                return await read_body(request.stream(), limit)
        except TimeoutError:
            raise ApiError(408, "body", f"body not received within {self.args.body_timeout_s} s") from None

    def _parse(self, body: bytes, index_set: IndexSet) -> ParsedQuery:
        manifest = index_set.manifest
        query = parse_search_request(body, manifest.dim, self.args.max_k, self.args.max_vectors,
                                     manifest.metric)
        check_work(query, self.args.max_work)
        for name, _ in query.params:
            if name not in index_set.supported:
                raise ApiError(422, f"params.{name}",
                               f"param {name!r} does not apply to {manifest.index_factory} "
                               f"(supported: {sorted(index_set.supported) or 'none'})")
        if manifest.metric == "cosine":
            query = ParsedQuery(prepare_vectors(query.matrix, "cosine"), query.k, query.params,
                                query.single, query.require_full)
        return query

    async def _search_batch(self, items: list[tuple[IndexSet, ParsedQuery]]) -> list[QueryResult]:
        """Whatever is in flight becomes one batch: one call per shard per (k, params) group, per
        index version (two only in the instant of a swap)."""
        first = items[0][0]
        if all(index_set is first for index_set, _ in items):  # the steady state: one version
            results = await self._search_version(first, [query for _, query in items])
        else:
            by_set: dict[int, list[int]] = {}
            for position, (index_set, _) in enumerate(items):
                by_set.setdefault(index_set.generation, []).append(position)
            groups = list(by_set.values())
            answers = await asyncio.gather(*[
                self._search_version(items[g[0]][0], [items[p][1] for p in g]) for g in groups])
            results = [None] * len(items)
            for positions, group_answers in zip(groups, answers, strict=True):
                for position, answer in zip(positions, group_answers, strict=True):
                    results[position] = answer
        self.metrics.batch_size.observe(float(sum(len(q.matrix) for _, q in items)))
        self.metrics.in_flight.set(self.in_flight)  # sampled per batch, not per request
        self.metrics.fanout_ms.observe(results[0].fanout_ms)
        return results  # type: ignore[return-value]

    def _search_version(self, index_set: IndexSet, queries: list[ParsedQuery]):
        call = index_set.call
        if self.args.hedge_after_ms:
            async def call(shard: int, query: ShardQuery):
                return await self._call_shard_hedged(index_set, shard, query)
        prepare = plain_query
        if index_set.assigner is not None:
            assigner, loop, executor = index_set.assigner, asyncio.get_running_loop(), self.executor

            def prepare(matrix: np.ndarray, k: int, params: dict):
                return loop.run_in_executor(executor, assigner.query, matrix, k, params)
        return search_batch(queries, call, len(index_set.shards), index_set.manifest.metric != "l2",
                            self.args.shard_timeout_s, self.metrics.shard_done, prepare)

    async def _call_shard_hedged(self, index_set: IndexSet, shard: int, query: ShardQuery):
        """Sent again after hedge_after_ms if not answered; the first answer wins, the other is
        cancelled."""
        tasks = [asyncio.ensure_future(index_set.call(shard, query))]
        try:
            done, _ = await asyncio.wait(tasks, timeout=self.args.hedge_after_ms / 1000.0)
            if not done:
                self.metrics.hedged.inc()
                tasks.append(asyncio.ensure_future(index_set.call(shard, query)))
            failure: BaseException | None = None
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        return task.result()
                    failure = task.exception()
            raise failure  # every call failed
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()  # call_shard cancels its Serve request

    async def _follow_pointer(self) -> None:
        """Poll IndexControl: switch to a new index version atomically (one attribute), report
        back what this replica serves and how many requests still hold an older version."""
        while True:
            try:
                current = self.active.generation
                old = sum(n for g, n in self.in_flight_by_generation.items() if g < current)
                pointer = await self.control.poll.remote(self.replica_id, current, old)
                if pointer["generation"] > current:
                    loaded = await IndexSet.load(pointer["generation"], pointer["index"], pointer["app"],
                                                 self.use_links)
                    replaced, self.active = self.active, loaded
                    if replaced.links is not None:  # its last requests drain first (swap waits)
                        asyncio.get_running_loop().call_later(60.0, replaced.links.close)
                    self.metrics.shard_names = [s.name for s in loaded.manifest.shards]
                    self.metrics.index_generation.set(loaded.generation)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # control restarting, manifest unreadable: keep serving, retry
                logger.warning("index pointer poll failed: %s", exc)
            await asyncio.sleep(self.args.pointer_poll_s)

    async def _follow_links(self) -> None:
        """Keep the served version's shard links in step with its replicas (once a second)."""
        while True:
            await asyncio.sleep(LINK_REFRESH_S)
            await self.active.refresh_links()
            self.metrics.shard_links.set(sum(self.active.links.count()))

    def _check_coverage(self, query: ParsedQuery, result: QueryResult) -> None:
        if result.answered == result.shards:
            self.metrics.coverage.inc(tags={"coverage": "full"})
            return
        self.metrics.coverage.inc(tags={"coverage": "partial" if result.answered else "none"})
        if result.answered == 0:
            if result.error:
                logger.warning("no shard answered: %s", result.error)
            raise ApiError(503, None, "no shard answered in time", self.args.retry_after_s)
        if query.require_full:
            raise ApiError(503, "require_full",
                           f"only {result.answered} of {result.shards} shards answered in time",
                           self.args.retry_after_s)

    def _render(self, query: ParsedQuery, result: QueryResult, started: float,
                index_set: IndexSet) -> bytes:
        total_ms = (time.perf_counter() - started) * 1000.0
        payload: dict = {}
        if query.single:
            payload.update(hits(result.ids[0], result.distances[0]))
        else:
            payload["results"] = [hits(i, d) for i, d in zip(result.ids, result.distances, strict=True)]
        payload["coverage"] = {"shards": result.shards, "answered": result.answered}
        payload["timing_ms"] = {"total": round(total_ms, 3), "compute": round(result.compute_ms, 3),
                                "queue": round(max(total_ms - result.compute_ms, 0.0), 3)}
        payload["index"] = index_set.manifest.index_version
        payload["batch"] = result.batch_size
        return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
