"""Router ingress, Serve glue only: routes, admission, batching, the index pointer and link follow.

The HTTP contract lives in shardserve.query.api, parsing in shardserve.query.parse, coverage and
rendering in shardserve.query.render; the fan-out, hedging and per-version grouping in
shardserve.query.fanout; one index version's handles and links in deployments.index_set.
"""

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import faiss
import numpy as np
import orjson
import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from deployments.autoscaling import ReportsCoresWanted
from deployments.chroma import PREFIX as CHROMA_PREFIX
from deployments.chroma import chroma_front
from deployments.chroma import respond as chroma_respond
from deployments.collections import CollectionsFront, default_root
from deployments.config import AppArgs, index_app_name
from deployments.index_set import IndexSet, follow_links
from deployments.metrics import RouterMetrics
from shardserve.embed.front import (
    Embedded,
    TextFront,
    embed_request,
    needs_embedder,
    text_search,
    text_upsert,
    upsert_body,
)
from shardserve.index.manifest import Manifest
from shardserve.query.api import ApiError, Limits, ParsedQuery
from shardserve.query.batcher import AdaptiveBatcher
from shardserve.query.fanout import search_grouped
from shardserve.query.merge import QueryResult
from shardserve.query.openapi import docs_reply
from shardserve.query.parse import is_npy, parse_query, receive_body
from shardserve.query.render import coverage_error, index_summary, render_search, windowed
from shardserve.query.scan_choice import shares_scan
from shardserve.runtime.heap import give_back, settled
from shardserve.runtime.procfs import lower_priority
from shardserve.tracing import Span, Traced, Tracer, end, now, traceparent
from shardserve.transport.http_front import FrontDoor, Reply
from shardserve.transport.http_front import Request as HttpRequest
from shardserve.transport.http_front import json_reply as _json
from shardserve.transport.shard_link import ShardLinks
from shardserve.writes.accept import (
    MAX_FILTER_DELETE,
    Evaluated,
    Matches,
    WriteFront,
    WriteTrace,
    delete_matching,
)
from shardserve.writes.delta import MAX_DELTA_ROWS
from shardserve.writes.follow import LogBehind
from shardserve.writes.locate import LogAddress
from shardserve.writes.log import LogMoved
from shardserve.writes.parse import delete_filter
from shardserve.writes.points import parse_count, parse_points, parse_scroll
from shardserve.writes.redis_log import LogUnavailable

logger = logging.getLogger("ray.serve")


def _error(error: ApiError) -> Reply:
    headers = {"Retry-After": str(int(error.retry_after))} if error.retry_after else {}
    return Reply(error.status, error.body(), headers=headers)


async def _read_request(request: Request, args: AppArgs) -> tuple[HttpRequest, str]:
    """(the request as the front door would see it, route prefix) of a request on Serve's path; the
    body bounded in size and time, so an upload holds no admission slot."""
    root = request.scope.get("root_path", "")  # Serve puts the route prefix here
    body = b""
    if request.method in ("POST", "PUT"):
        body = await receive_body(request.stream(), request.headers.get("content-length"),
                                  args.max_body_bytes, args.body_timeout_s)
    raw = request.scope.get("raw_path")  # as sent, as the front door sees it (Chroma's names decode once)
    route = (raw.decode("latin-1") if raw else request.scope.get("path", ""))[len(root):]
    headers = request.headers
    return HttpRequest(request.method, route, body, request.url.query, headers.get("content-type", ""),
                       headers.get("x-shardserve-lane", ""), headers.get("traceparent", "")[:64]), root


async def _first_index(control: DeploymentHandle, replica_id: str, args: AppArgs, app_name: str,
                       use_links: bool) -> IndexSet:
    """What a starting replica serves: the pointer's version (a replica started after a swap), or
    the configured index when the pointer cannot be reached."""
    try:
        p = await asyncio.wait_for(control.poll.remote(replica_id, -1, 0), 10.0)
        return await IndexSet.load(p["generation"], p["index"], p["app"], use_links)
    except Exception as exc:
        logger.warning("index pointer not reachable (%s): serving the configured index", exc)
        return await IndexSet.load(0, args.index, index_app_name(app_name), use_links)


def _write_front(log: LogAddress | None, a: AppArgs, metrics: RouterMetrics) -> WriteFront:
    """The router's writes: each commit's requests counted in shardserve_write_group_requests."""
    return WriteFront(log, a.max_write_points, retry_after_s=a.retry_after_s,
                      on_commit=metrics.write_group.observe)


async def _write(router: "Router", request: HttpRequest, upsert: bool) -> Reply:
    """An upsert or a delete: 200 with its log position once it is durable (shardserve.writes.accept)."""
    async def answer(span: Span | None) -> Reply:
        active = router.active  # one version: its manifest checks the body, its log takes it
        npy = is_npy(request.content_type)  # ids then vectors as .npy arrays (writes.parse)
        body, served = request.body, lambda: _served(router)
        limit = min(router.args.max_write_points, router.args.max_texts)
        if upsert and not npy and (texts := text_upsert(body, limit, router.args.max_text_chars)) is not None:
            # embedded before the log append: the log holds vectors, and a replay never embeds again;
            # the rest of the body, and whether the write can be taken now, checked before the model
            _text_lane(request, router)
            payload, texts_ = texts
            router.writes.check_upsert(upsert_body(payload, np.ones((len(texts_), active.manifest.dim),
                                                                    np.float32)), active.manifest, active.log)
            embedded = await _embed(router, active, texts_, "texts", span)
            body, served = upsert_body(payload, embedded.vectors), _same_model(router, active.manifest)
        if not upsert and not npy and _filter(active, body) is not None:  # deleted by id once found
            return _json(await delete_matching(router.writes, lambda: _evaluate(router, body),
                                               served=lambda: _served(router)))
        trace = None if span is None else WriteTrace(traceparent(span))
        accepted = await router.writes.accept(body, upsert, active.manifest, active.log, served=served,
                                              npy=npy, trace=trace)  # `served` read again at its turn
        if span is None or trace is None:
            return _json(accepted)
        _write_spans(router.tracer, span, trace)
        rendering = now()  # the acknowledgement: the durable write's 200, rendered
        reply = _json(accepted)
        router.tracer.child(span, "answer", rendering, now())
        return reply

    return await _traced_route(router, "upsert" if upsert else "delete", request, answer,
                               "upsert" if upsert else "delete")


def _write_spans(tracer: Tracer, span: Span, trace: WriteTrace) -> None:
    """A traced write's way through the write front, as spans: its parse, then its log append from
    joining the queue to its commit, holding the group commit it rode in (one transaction and one
    fsync for the `requests` queued together)."""
    tracer.child(span, "parse", trace.arrived, trace.queued)
    append = tracer.child(span, "log append", trace.queued, trace.committed)
    tracer.child(append, "group commit", trace.commit_started, trace.committed,
                 attributes={"requests": trace.group})


async def _traced_route(router: "Router", route: str, request: HttpRequest,
                        answer: Callable[[Span | None], Awaitable[Reply]], name: str) -> Reply:
    """`answer(span)` counted as `_counted` does, and a trace of its own when sampled: the route's
    span (`name`; `span`, None when not traced) and the trace named in the reply."""
    span = router.tracer.begin(name, request.traceparent)
    if span is None:
        return await _counted(router, route, lambda: answer(None))
    status = 500
    try:
        reply = await _counted(router, route, lambda: answer(span))
        status = reply.status
        return _traced_reply(reply, span)
    finally:
        end(span, **{"http.response.status_code": status})


def _same_model(router: "Router", embedded_for: Manifest) -> Callable[[], tuple]:
    """`_served` for a text upsert embedded with `embedded_for`'s model: a 503 (nothing written)
    if a swap has brought an index of another model, or none, before its append."""
    def served() -> tuple:
        now = _served(router)
        if now[0] is not embedded_for and now[0].embedder != embedded_for.embedder:
            raise ApiError(503, None, "the index served changed its embedding model while the write "
                                      "waited: send it again", router.args.retry_after_s)
        return now
    return served


async def _embed(router: "Router", active: IndexSet, texts: list[str], field: str = "text",
                 parent: Span | None = None) -> Embedded:
    """`texts` as vectors of `active`'s model: the router's cache, then its embedder (a 503 when the
    embedder is gone, late, or the text admission is full). `parent`: a traced request's span."""
    needs_embedder(active.manifest, field)
    embedder = active.embedder
    assert embedder is not None  # a manifest with an embedder has one
    span = None if parent is None else router.tracer.child(parent, "embed", attributes={"texts": len(texts)})

    async def call(missing: list[str]) -> tuple[np.ndarray, tuple[int, ...]]:
        if span is None:
            return await embedder.embed.remote(missing)
        return await embedder.embed.remote(missing, traceparent(span))

    hits, misses = router.text.cache.hits, router.text.cache.misses
    try:
        embedded = await router.text.embed(active.manifest, texts, call)
    except ApiError as error:
        if error.status == 503:
            router.metrics.text_shed.inc()
        raise
    except Exception as exc:  # the replica gone, restarting, or failed on this call: nothing written
        router.metrics.text_shed.inc()
        logger.warning("embedder call failed: %s", exc)
        raise ApiError(503, None, f"the embedder did not answer: {type(exc).__name__}",
                       router.args.retry_after_s) from None
    finally:
        router.metrics.embed_lookups(router.text.cache.hits - hits, router.text.cache.misses - misses)
        end(span, **{"cache.hits": router.text.cache.hits - hits,
                     "cache.misses": router.text.cache.misses - misses})
    router.metrics.embed_ms.observe(embedded.ms)
    return embedded


async def _embed_route(router: "Router", request: HttpRequest) -> Reply:
    """POST /v1/embed: the vectors of `texts` under the served index's model."""
    async def answer(span: Span | None) -> Reply:
        active = router.active
        texts = embed_request(request.body, router.args.max_texts, router.args.max_text_chars)
        embedded = await _embed(router, active, texts, "texts", span)
        return Reply(200, orjson.dumps({"vectors": embedded.vectors, **embedded.describe(active.manifest),
                                        "dim": embedded.vectors.shape[1]},
                                       option=orjson.OPT_SERIALIZE_NUMPY))

    return await _traced_route(router, "embed", request, answer, "embed request")


POINT_ROUTES = ("/v1/points", "/v1/count", "/v1/scroll")


async def _points_route(router: "Router", request: HttpRequest, route: str) -> Reply:
    """POST /v1/points (get by ids), /v1/count and /v1/scroll (shardserve.writes.points): each
    shard answers once it applied every write committed before, as for a search."""
    async def answer() -> Reply:
        active, timeout_s, max_page = router.active, router.args.shard_timeout_s * 4, router.args.max_page
        manifest = active.manifest
        if router.in_flight >= router.args.max_in_flight:  # admitted as searches are: a fast 503
            router.metrics.shed.inc()
            raise ApiError(503, None, f"overloaded: {router.in_flight} requests in flight",
                           router.args.retry_after_s)
        router.in_flight += 1
        try:
            if route == "/v1/points":
                points = await active.points(parse_points(request.body, manifest, max_page), timeout_s)
                return _json({"points": points, "index": manifest.index_version})
            if route == "/v1/count":
                return _json({"count": await active.count(parse_count(request.body, manifest), timeout_s),
                              "index": manifest.index_version})
            points, after = await active.scroll(parse_scroll(request.body, manifest, max_page), timeout_s)
            return _json({"points": points, "next": after, "index": manifest.index_version})
        except (TimeoutError, LogBehind, LogUnavailable, RayActorError,
                ActorUnavailableError) as exc:  # a shard late, restarting or behind its log
            logger.warning("%s: a shard did not answer: %r", route, exc)
            raise ApiError(503, None, f"not every shard answered: {type(exc).__name__}",
                           router.args.retry_after_s) from None
        finally:
            router.in_flight -= 1

    return await _counted(router, route.rsplit("/", 1)[1], answer)


def _text_front(a: AppArgs) -> TextFront:
    """The replica's texts: its embedding cache, its text admission and its text limits."""
    return TextFront(a.embedding_cache_bytes, a.max_texts_in_flight, a.embed_timeout_s, a.retry_after_s,
                     a.max_texts, a.max_text_chars)


async def _health(router: "Router") -> Reply:
    """GET /v1/health: 200 when every shard of the served index answers, else 503 with Retry-After."""
    try:
        infos = await router.active.shard_infos(timeout_s=5.0)
    except Exception as exc:  # a shard not (yet) up: not ready
        return _error(ApiError(503, None, f"not ready: {type(exc).__name__}", router.args.retry_after_s))
    return _json({"status": "ok", "shards": len(infos), "index": router.active.manifest.index_version,
                  "links": router.active.link_counts()})


def _summary(router: "Router") -> Reply:
    """GET /v1/index: the version served, its limits, and those of text requests."""
    active = router.active
    return _json(index_summary(active.manifest, active.supported, router.limits, router.text.limits))


def _described(embedded: Embedded | None, index_set: IndexSet) -> dict | None:
    return None if embedded is None else embedded.describe(index_set.manifest)


async def _counted(router: "Router", route: str, answer: Callable[[], Awaitable[Reply]]) -> Reply:
    """`answer()`, its ApiError as the error reply, and the request counted by the status the
    client gets (500 for anything else raised)."""
    started, status = time.perf_counter(), 500
    try:
        reply = await answer()
        status = reply.status
        return reply
    except ApiError as error:
        status = error.status
        return _error(error)
    finally:
        router.metrics.observe_request(started, status, route)


async def _parsed(router: "Router", index_set: IndexSet, request: HttpRequest,
                  span: Span | None = None) -> tuple[ParsedQuery, Embedded | None]:
    """A search request as a query of `index_set`: by vector, or by text ({"text": ...} or
    {"texts": [...]}): every other field checked first (against stand-in vectors), so a request
    that would be refused costs no model run; then embedded, then checked as a vector search is."""
    text = None if is_npy(request.content_type) else text_search(request.body, router.args.max_texts,
                                                                  router.args.max_text_chars)
    if text is None:
        return parse_query(request, index_set.manifest, index_set.supported, router.limits), None
    payload, texts, single = text
    _text_lane(request, router)
    field = "vector" if single else "vectors"
    stand_in = np.ones((len(texts), index_set.manifest.dim), np.float32)
    parse_query(request, index_set.manifest, index_set.supported, router.limits, {**payload, field: stand_in})
    embedded = await _embed(router, index_set, texts, "text" if single else "texts", span)
    payload[field] = embedded.vectors
    return parse_query(request, index_set.manifest, index_set.supported, router.limits, payload), embedded


async def _parsed_traced(router: "Router", index_set: IndexSet, request: HttpRequest,
                         span: Span | None) -> tuple[ParsedQuery, Embedded | None]:
    """_parsed; for a traced request (`span`), its parse (and embedding) as spans, and the query
    carrying its trace into the batch."""
    if span is None:
        return await _parsed(router, index_set, request)
    parse = router.tracer.child(span, "parse")
    try:
        query, embedded = await _parsed(router, index_set, request, parse)
    finally:
        parse.end()
    return dataclasses.replace(query, trace=Traced(router.tracer, span, now())), embedded


def _batch_waits(tracer: Tracer, items: list[tuple[IndexSet, ParsedQuery]]) -> None:
    """Each traced request's wait for its batch, from joining the queue to the batch's start."""
    if not tracer.on:
        return
    started = now()
    for _, query in items:
        if (traced := query.trace) is not None:
            traced.tracer.child(traced.span, "batch wait", traced.queued, started,
                                {"batch.requests": len(items)})


def _rendered(router: "Router", span: Span | None, started: float, query: ParsedQuery, result: QueryResult,
              index_set: IndexSet, extra: list[list[dict]] | None, embedded: Embedded | None) -> Reply:
    """A search's 200: its answer rendered (as a span of a traced request), `timing_ms` counted from
    `started` (a perf_counter reading)."""
    rendering = now() if span is not None else 0.0
    total_ms = (time.perf_counter() - started) * 1000.0
    reply = Reply(200, render_search(query, result, total_ms, index_set.manifest.index_version, extra,
                                     _described(embedded, index_set)))
    if span is not None:
        router.tracer.child(span, "answer", rendering, now())
    return _traced_reply(reply, span)


def _traced_reply(reply: Reply, span: Span | None) -> Reply:
    """The reply, carrying its trace's id (the W3C `traceresponse` header) when traced."""
    if span is not None:
        reply.headers["traceresponse"] = traceparent(span)
    return reply


def _text_lane(request: HttpRequest, router: "Router") -> None:
    """A text request the edge sent down its vector lane (it names text where the edge's look at
    the body did not find it: an escaped key, or past the edge's buffer) would hold a vector slot
    for a model run: a 422 instead, saying how to send it."""
    if request.lane == "vector":
        raise ApiError(422, "text", "a text request must name \"text\" or \"texts\" as a plain key "
                                    "within the body's first 64 KiB (the edge routes it by that)")


async def _evaluate(router: "Router", body: bytes) -> Evaluated:
    """A delete by filter evaluated on the version served now (after a swap, the new one): its
    filter checked against that version's columns, then every shard's matches."""
    active = router.active
    if active.log is None:  # before asking the shards
        raise router.writes.no_log()
    where = _filter(active, body)
    assert where is not None  # the same body as when it was taken for a delete by filter
    router.in_flight_by_generation[active.generation] += 1  # a swap's drain waits for it, as for searches
    try:
        return await _matching(router, active, where), active.manifest, active.log, where
    except ApiError:
        if router.active is not active:  # its shards went with a swap: ask the new version's
            raise LogMoved("the server moved to another index while its shards were asked") from None
        raise
    finally:
        router.in_flight_by_generation[active.generation] -= 1


def _filter(active: IndexSet, body: bytes) -> str | None:
    """A /v1/delete body's filter, checked against the columns of the version `active` (a 422 if
    it does not fit them); None for a delete by ids."""
    return delete_filter(body, active.manifest.dataset.metadata_kinds,
                         max(s.num_vectors for s in active.manifest.shards))


async def _matching(router: "Router", active: IndexSet, where: str) -> Matches:
    """A delete by filter's matches from every shard; a shard that cannot answer (gone, late, its
    log unreadable) is a 503: nothing was written, the client may send it again."""
    try:
        return await active.ids_matching(where, MAX_FILTER_DELETE, router.args.shard_timeout_s * 5)
    except (TimeoutError, RayActorError, ActorUnavailableError, RayServeException, LogUnavailable,
            LogBehind) as exc:
        raise ApiError(503, None, f"the shards did not all answer the filter: {type(exc).__name__}",
                       router.args.retry_after_s) from None


async def _included(router: "Router", index_set: IndexSet, query: ParsedQuery,
                    result: QueryResult) -> list[list[dict]] | None:
    """`include`'s metadata of the hits; a shard that cannot answer it (gone, late, its log
    unreadable or being re-read) is a 503, as for a delete by filter's matches."""
    try:
        return await index_set.metadata(query, result, router.args.shard_timeout_s)
    except (TimeoutError, RayActorError, ActorUnavailableError, RayServeException, LogUnavailable,
            LogBehind) as exc:
        raise ApiError(503, None, f"the shards did not all answer `include`: {type(exc).__name__}",
                       router.args.retry_after_s) from None


def _shape_batches(batcher: AdaptiveBatcher, args: AppArgs, manifest: Manifest) -> None:
    """The batch fill and the batches in flight for the index served (AppArgs.fill_for, batching):
    where a batch shares each shard's scan, batches fill and run one per shard replica."""
    shared = shares_scan(manifest)
    batcher.fill = args.fill_for(shared)
    batcher.max_concurrent, batcher.at_once, batcher.overlap_min_size = args.batching(shared)


def _now_serving(router: "Router", loaded: IndexSet) -> None:
    """A swap done: the metrics and the batches follow the index now served."""
    router.metrics.follow(loaded.manifest, loaded.generation)
    _shape_batches(router.batcher, router.args, loaded.manifest)


def _served(router: "Router") -> tuple:
    """The served version's manifest and log, from one read of the pointer (any thread)."""
    active = router.active
    return active.manifest, active.log


def _let_go(links: ShardLinks | None) -> None:
    """A replaced index version, drained: its links closed, the memory it held handed back."""
    if links is not None:
        links.close()
    give_back()


def _collections_route(router: "Router", request: HttpRequest,
                       route: str) -> tuple[str, Callable[[], Awaitable[Reply]]] | None:
    """(metrics label, answer) of a native collections route or a Chroma one; None for others."""
    if route == "/v1/collections" or route.startswith("/v1/collections/"):
        return "collections", lambda: router.collections.respond(request, route)
    if route == CHROMA_PREFIX or route.startswith(CHROMA_PREFIX + "/"):
        return "chroma", lambda: chroma_respond(router.chroma, request)
    return None


@serve.deployment(max_ongoing_requests=512)
class Router(ReportsCoresWanted):
    """Plain ASGI-request ingress (no per-request FastAPI stack): exact routes under its prefix."""

    async def __init__(self, control: DeploymentHandle, args: dict):  # type: ignore[misc]  # Serve awaits it
        self.args = a = AppArgs.model_validate(args)
        self.limits = Limits(a.max_k, a.max_vectors, a.max_work, a.max_body_bytes, a.max_write_points,
                             MAX_DELTA_ROWS, max_page=a.max_page)
        self.control, self.use_links = control, a.shard_transport == "link"
        self.replica_id = (context := serve.get_replica_context()).replica_id.unique_id
        self.active = await _first_index(control, self.replica_id, a, context.app_name, self.use_links)
        self.metrics = RouterMetrics(context.app_name)
        self.metrics.follow(self.active.manifest, self.active.generation)
        self.in_flight, self.in_flight_by_generation = 0, Counter[int]()
        self.executor = ThreadPoolExecutor(1, "quantizer", faiss.omp_set_num_threads, (1,))  # large batches
        self.writes, self.text = _write_front(self.active.log, a, self.metrics), _text_front(a)
        self.tracer = Tracer(a.trace_config("shardserve-router"), {"shardserve.replica": self.replica_id})
        root = Path(a.collections_dir) if a.collections_dir else default_root(a.index)
        self.collections = CollectionsFront(root, a, self.limits)
        self.chroma = chroma_front(self.collections, a)
        self.batcher = AdaptiveBatcher(self._search_batch, a.max_batch_size, 1,
                                       size_of=lambda item: len(item[1].matrix))
        _shape_batches(self.batcher, a, self.active.manifest)
        jobs = [self._follow_pointer(), self.metrics.export_histograms(),
                *([follow_links(lambda: self.active, self.metrics.shard_links)] if self.use_links else [])]
        self._tasks = [asyncio.get_running_loop().create_task(job) for job in jobs]
        self.front = FrontDoor(self.respond, a.max_body_bytes, a.body_timeout_s)  # own HTTP door
        if a.front_port is not None:  # SO_REUSEPORT: the replicas on a node share the port
            host = ray.util.get_node_ip_address() if a.front_host == "node" else a.front_host
            await self.front.listen(host, a.front_port)
        lower_priority(a.serving_nice)  # a replica starting beside this one gets the CPU first
        self.pauses = settled(logger)  # start-up's objects frozen out of every full collection

    async def __call__(self, request: Request) -> Response:
        """Serve's HTTP path (its proxy or HAProxy ingress): the same answers as the front door."""
        try:
            reply = await self.respond(*await _read_request(request, self.args))
        except ApiError as error:
            reply = _error(error)
        return Response(reply.body, reply.status, reply.headers, reply.content_type)

    async def respond(self, request: HttpRequest, root: str = "") -> Reply:
        """Every route, for both doors: Serve's HTTP path and this replica's own (transport.http_front)."""
        method, route = request.method, request.path.rstrip("/") or "/"
        if route == "/v1/search" and method == "POST":
            return await self.search(request)
        if method == "POST" and route in ("/v1/upsert", "/v1/delete", "/v1/embed"):
            return await (_embed_route(self, request) if route == "/v1/embed"
                          else _write(self, request, route == "/v1/upsert"))
        if method == "POST" and route in POINT_ROUTES:
            return await _points_route(self, request, route)
        if (collections := _collections_route(self, request, route)) is not None:
            return await _counted(self, *collections)
        if method == "GET" and route in ("/v1/health", "/v1/index"):
            return await _health(self) if route == "/v1/health" else _summary(self)
        if method == "GET" and (docs := docs_reply(route, root)) is not None:
            return docs
        return _json({"error": f"no route {method} {route}", "field": None}, 404)

    async def search(self, request: HttpRequest) -> Reply:
        """k nearest neighbours of one vector (`vector`) or of a batch (`vectors`), JSON or .npy."""
        span = self.tracer.begin("search", request.traceparent)  # None unless traced; it holds timing_ms
        started, status, index_set = time.perf_counter(), 200, None
        try:
            if self.in_flight >= self.args.max_in_flight:  # shed before any parsing: a fast 503
                self.metrics.shed.inc()
                raise ApiError(503, None, f"overloaded: {self.in_flight} requests in flight",
                               self.args.retry_after_s)
            self.in_flight += 1
            index_set = self.active  # answered by this version only, even mid-swap
            self.in_flight_by_generation[index_set.generation] += 1
            query, embedded = await _parsed_traced(self, index_set, request, span)
            result: QueryResult = await self.batcher.submit((index_set, query))
            if result.answered == 0 and result.error:
                logger.warning("no shard answered: %s", result.error)
            if error := coverage_error(query, result, self.args.retry_after_s):
                raise error
            result = windowed(query, result, index_set.manifest.metric != "l2")
            extra = await _included(self, index_set, query, result)
            return _rendered(self, span, started, query, result, index_set, extra, embedded)
        except ApiError as error:
            status = error.status
            return _traced_reply(_error(error), span)
        except BaseException:
            status = 500
            raise
        finally:
            end(span, **{"http.response.status_code": status})
            if index_set is not None:
                self.in_flight -= 1
                self.in_flight_by_generation[index_set.generation] -= 1
            self.metrics.observe_request(started, status)

    async def _search_batch(self, items: list[tuple[IndexSet, ParsedQuery]]) -> list[QueryResult]:
        """Whatever is in flight is one batch: one call per shard per (k, params) group and version."""
        a = self.args
        _batch_waits(self.tracer, items)
        results = await search_grouped(items, lambda index_set, queries: index_set.search(
            queries, self.executor, a.shard_timeout_s, a.hedge_after_ms / 1000.0, self.metrics))
        self.metrics.observe_batch(items, results, self.in_flight)
        return results

    async def _follow_pointer(self) -> None:
        """Poll IndexControl: switch to a new index version atomically (one attribute), report
        back what this replica serves and how many requests still hold an older version."""
        while True:
            try:
                current = self.active.generation
                old = sum(n for g, n in self.in_flight_by_generation.items() if g < current)
                p = await self.control.poll.remote(self.replica_id, current, old)
                if p["generation"] > current:
                    loaded = await IndexSet.load(p["generation"], p["index"], p["app"], self.use_links)
                    links, self.active = self.active.links, loaded  # nothing else of the old kept
                    # its last requests drain first (swap waits); then its memory goes back
                    asyncio.get_running_loop().call_later(60.0, _let_go, links)
                    _now_serving(self, loaded)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # control restarting, manifest unreadable: keep serving, retry
                logger.warning("index pointer poll failed: %s", exc)
            await asyncio.sleep(self.args.pointer_poll_s)
