"""Shard deployment: one Serve deployment per shard, each replica holding that shard's index."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import pyarrow as pa
import ray
from ray import serve

from deployments.config import INDEX_INGRESS
from shardserve.errors import ServingError
from shardserve.index.indexes import BLAS_MIN_ROWS, flat_search_with_blas_from, supported_params
from shardserve.index.manifest import read_shard_checked, read_version
from shardserve.index.storage import Location
from shardserve.query.searcher import ShardSearcher
from shardserve.runtime.heap import settled
from shardserve.runtime.procfs import age_seconds, cpu_seconds, lower_priority, memory_mb
from shardserve.runtime.warm_pool import WarmPool
from shardserve.tracing import SpanKind, TraceConfig, Tracer, end, now, parse_traceparent
from shardserve.transport.shard_link import InFlight, LinkLimits, serve_link, shard_secret
from shardserve.transport.shard_wire import ShardQuery, encode_answer
from shardserve.writes.follow import LogBehind, ShardWrites
from shardserve.writes.locate import log_address
from shardserve.writes.log import Entry

INLINE_ROWS = 32  # query rows up to which a search runs on the event loop (a short IVF scan)
ANNOUNCE_EVERY_S = 2.0  # the directory forgets a replica after 3 missed announcements
WITHDRAW_TIMEOUT_S = 2.0  # of a stopping replica's graceful shutdown budget
FOLLOW_EVERY_S = 0.25  # an idle replica applies new writes this often (a search applies them anyway)
logger = logging.getLogger("ray.serve")


@serve.deployment(max_ongoing_requests=16, health_check_period_s=5)
class ShardDeployment:
    """Thin: loads a ShardSearcher (sha256-checked), answers router batches over its shard link
    (shardserve.transport.shard_link) or a Serve handle call, both through `search`."""

    async def __init__(self, index: str, shard: int, *, faiss_threads: int = 1,  # type: ignore[misc]
                       link_secret: str | None = None,
                       index_version: str | None = None, nice: int = 0, mmap: bool = True,
                       warm_workers: int = 0, max_rows: int = 2048, max_k: int = 100,
                       max_frame: int = 16 * 1024 * 1024, trace_endpoint: str | None = None,
                       trace_ratio: float | None = None):
        """`link_secret` (hex, the index version's): listen on a shard link that callers must prove
        it to; None: Serve handle calls only. `max_rows`, `max_k`, `max_frame`: what one batch may
        hold (shardserve.transport.shard_wire.QueryBounds, shardserve.transport.shard_link.LinkLimits).
        `trace_endpoint`, `trace_ratio`: AppArgs' (a traced batch's part here is a span of this replica)."""
        constructing = time.monotonic()
        # OpenMP's thread count is per calling thread: set it in the one thread that searches, or
        # FAISS uses every core from a fresh thread: shards on one node then oversubscribe its cores.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="faiss",
                                           initializer=faiss.omp_set_num_threads,
                                           initargs=(faiss_threads,))
        location, loading = Location.parse(index), time.monotonic()
        manifest = read_version(location, index_version)
        self.searcher = await asyncio.to_thread(ShardSearcher.load, location, manifest, shard, mmap)
        trained = manifest.trained
        # The write log's requests past this version, applied before the first answer and again
        # before each one (shardserve.writes.follow): a 200 to a write is visible to any search after it.
        self.writes = ShardWrites(self.searcher, shard, len(manifest.shards), log_address(index),
                                  manifest.log_position,
                                  lambda: read_shard_checked(location, trained) if trained else None)
        await asyncio.to_thread(self.writes.catch_up, True)  # the log unreadable: not started
        loaded_s = time.monotonic() - loading
        self.bounds = self.searcher.query_bounds(
            max_rows=max_rows, max_k=max_k,
            params=supported_params(manifest.index_factory, manifest.dim, manifest.metric))
        flat_search_with_blas_from(BLAS_MIN_ROWS, self.searcher.dim)  # a flat shard's batches
        self.node_id = ray.get_runtime_context().get_node_id()
        self.tracer = Tracer(TraceConfig.resolve(trace_endpoint, trace_ratio, "shardserve-shard"),
                             {"shardserve.shard": manifest.shards[shard].name,
                              "shardserve.replica": serve.get_replica_context().replica_id.unique_id})
        if self.tracer.on:  # a traced write's apply here: a span in the write's trace
            self.writes.on_applied = self._applied
        self.faiss_threads = faiss_threads
        self.shard = shard
        self.link_in_flight = InFlight()
        self.link_server: asyncio.Server | None = None
        self._announcer: asyncio.Task | None = None
        self.replica = ""
        if link_secret is not None:
            host = _link_host()
            self.link_server = await serve_link(
                self.search, host, 0, secret=shard_secret(bytes.fromhex(link_secret), shard),
                in_flight=self.link_in_flight,
                answer_now=self.answer_now, limits=LinkLimits(max_frame=max_frame + 4096))
            context = serve.get_replica_context()
            self.app, self.replica = context.app_name, context.replica_id.unique_id
            self._announcer = asyncio.get_running_loop().create_task(self._announce(
                host, self.link_server.sockets[0].getsockname()[1]))
        lower_priority(nice)  # last: the start-up itself ran at the node's priority
        self.pauses = settled(logger)  # start-up's objects frozen out of every full collection
        # The node's pool of idle workers that the next replica placed here takes (runtime.warm_pool).
        self.warm_pool = WarmPool(warm_workers).start()
        self._follower = asyncio.get_running_loop().create_task(self._follow_log())
        self.startup = {"process_age_s": round(age_seconds(os.getpid()), 3),
                        "constructor_s": round(time.monotonic() - constructing, 3),
                        "cpu_s": round(cpu_seconds(os.getpid()), 3), "index_load_s": round(loaded_s, 3),
                        "mmapped": self.searcher.mmapped, **memory_mb(os.getpid()), "ready_at": time.time()}
        keep_startup(self.startup)

    async def search(self, query: bytes) -> bytes:
        """A router batch (shardserve.transport.shard_wire bytes) → its top-k answer bytes.

        Small batches are searched right on the event loop (`answer_now`): a hand-off to the search
        thread and back cost more CPU than scanning a few lists. Larger ones go to the search thread
        (FAISS releases the GIL, the replica's event loop stays free).
        """
        answer = self.answer_now(query)
        if answer is not None:
            return answer
        loop = asyncio.get_running_loop()
        arrived = now() if self.tracer.on else 0.0  # a traced batch's wait for the search thread
        return await loop.run_in_executor(self.executor, self._answer, query, arrived)

    def answer_now(self, query: bytes) -> bytes | None:
        """The answer of a small batch, computed at once (None: large, `search` hands it off). The
        shard link calls it straight from its receive callback: no task per frame, and no `search`
        either, so a subclass that changes `search` (tests/faults.py) must return None here."""
        if ShardQuery.rows(query) > INLINE_ROWS:
            return None
        decoded = ShardQuery.decode(query, self.bounds)
        where = decoded.params.get("filter")
        if where is not None and not self.searcher.filter_ready(where):
            return None  # a new filter's first pass over the rows runs off the event loop
        faiss.omp_set_num_threads(self.faiss_threads)  # per thread: this is the loop's thread
        if decoded.trace and self.tracer.on:
            return self._traced(decoded, now())
        return encode_answer(*self.writes.answer(decoded))

    def _answer(self, query: bytes, arrived: float = 0.0) -> bytes:
        decoded = ShardQuery.decode(query, self.bounds)
        if decoded.trace and self.tracer.on:
            return self._traced(decoded, arrived)
        return encode_answer(*self.writes.answer(decoded))

    def _traced(self, query: ShardQuery, arrived: float) -> bytes:
        """A traced batch's answer, and this replica's part of its trace: a span under the router's
        fan-out span, with the batch's wait for the search thread and its search as children."""
        started = now()
        answer = self.writes.answer(query)
        ended = now()
        parent = parse_traceparent(query.trace)
        assert parent is not None  # ShardQuery.decode checked it
        span = self.tracer.child(parent, f"shard {self.shard}", arrived, kind=SpanKind.SERVER,
                                 attributes={"rows": len(query.matrix), "k": query.k})
        self.tracer.child(span, "queue wait", arrived, started)
        # the writes' catch-up, then FAISS: its own time, measured by the searcher, at the end
        self.tracer.child(span, "faiss", max(started, ended - answer[2] / 1000.0), ended)
        end(span, ended, **{"log.position": answer[4]})
        return encode_answer(*answer)

    def _applied(self, entries: list[Entry], started: float, ended: float) -> None:
        """This replica's apply of traced writes (ShardWrites.on_applied): a span under each write's
        own span, from the log read to the last request applied, however long after its 200."""
        for entry in entries:
            parent = parse_traceparent(entry.trace or "")
            if parent is not None and parent.trace_flags.sampled and self.tracer.allow():
                self.tracer.child(parent, "apply", started, ended, kind=SpanKind.CONSUMER,
                                  attributes={"log.position": entry.position, "operations": len(entry.ops),
                                              "requests": len(entries)})

    async def _follow_log(self) -> None:
        """Apply new writes while idle too, in the search thread: the next search finds less to do."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(FOLLOW_EVERY_S)
            try:
                await loop.run_in_executor(self.executor, self.writes.catch_up)
            except asyncio.CancelledError:
                raise
            except LogBehind:  # the replica said so once, and rebuilds on its own
                pass
            except Exception as exc:  # a gap, a locked log: searches report it too, keep trying
                logger.warning("write log: %s", exc)

    async def _announce(self, host: str, port: int) -> None:
        """Tell the index version's directory where this replica listens, again every few seconds
        (a directory restart, or a missed beat, heals by itself)."""
        directory = serve.get_deployment_handle(INDEX_INGRESS, self.app)
        while True:
            try:
                await directory.announce.remote(self.shard, self.replica, host, port)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not up yet, restarting: routers use Serve calls meanwhile
                logger.info("shard link announce failed: %s", exc)
            await asyncio.sleep(ANNOUNCE_EVERY_S)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Link traffic does not pass through Serve's request counters: report its mean in-flight
        count so the autoscaling policy (deployments.autoscaling) sees this replica's real depth."""
        return {"link_in_flight": self.link_in_flight.mean_and_reset()}

    async def __del__(self):
        """Serve's graceful shutdown (it awaits this): stop announcing, withdraw the directory entry
        so routers stop dialling this port (another process may take it once it is free), close."""
        self._follower.cancel()
        if self._announcer is not None:
            self._announcer.cancel()
            try:
                directory = serve.get_deployment_handle(INDEX_INGRESS, self.app)
                withdrawn = directory.withdraw.remote(self.shard, self.replica)
                await asyncio.wait_for(withdrawn, WITHDRAW_TIMEOUT_S)
            except Exception as exc:  # the version's app is going too: its directory with it
                logger.info("shard link withdraw failed: %s", exc)
        if self.link_server is not None:
            self.link_server.close()

    def metadata(self, ids: list[int], columns: list[str]) -> list[dict | None]:
        """The metadata of those `ids` this shard holds (None for the others'); `include` answers."""
        return self.writes.lookup(ids, columns)

    def ids_matching(self, where: str, limit: int) -> tuple[np.ndarray, int, int, pa.Schema | None]:
        """The live ids this shard holds that pass a checked filter, their count, the log position
        they were found at (a delete by filter; ShardWrites.ids_matching), and the arrow schema
        its metadata is held in: the router evaluates the filter on later upserts' metadata with
        it (shardserve.writes.roll), as this shard's delta does (a float32 column compares as
        float32 on both)."""
        metadata = self.searcher.metadata
        return (*self.writes.ids_matching(where, limit), None if metadata is None else metadata.table.schema)

    def points(self, ids: list[int], columns: list[str],
               vectors: bool) -> tuple[list[dict | None], np.ndarray | None, int]:
        """A get by ids: the `columns` (and vectors) of those `ids` this shard holds live, and the
        log position that state is at (ShardWrites.points)."""
        return self.writes.points(ids, columns, vectors)

    def scroll(self, after: int | None, limit: int, where: str | None) -> np.ndarray:
        """A scroll page's part: this shard's first `limit` live ids past `after` (passing `where`)."""
        return self.writes.page(after, limit, where)

    def count(self, where: str | None) -> int:
        """This shard's live points (passing `where`), every committed write applied."""
        if where is None:
            self.writes.catch_up()
            return self.writes.live_rows()
        return len(self.writes.live_ids(where)[0])

    def info(self) -> dict:
        return {"name": self.searcher.name, "ntotal": self.writes.live_rows(),
                "log_position": self.writes.position,
                "index_version": self.searcher.index_version, "node_id": self.node_id,
                "startup": self.startup}

    def check_health(self) -> None:
        if self.searcher.index.ntotal < 0:
            raise ServingError("shard index lost")


def _link_host() -> str:
    """Where the link listens: loopback on a one-node Ray (its routers are on this node), else the
    node's address, which routers on other nodes reach. A router that cannot reach it (a node
    added later) calls the shard through Serve instead."""
    if len([node for node in ray.nodes() if node.get("Alive")]) <= 1:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


STARTUP_KEY = "replica-start/{app}/{deployment}/{replica}"  # GCS key-value (shardserve.runtime.ray_private)


def keep_startup(startup: dict) -> None:
    """What this replica's start cost (process age and CPU when ready, index load), kept where a
    load test or an operator reads it back (`replica_startups`): how fast autoscaling can react is
    bounded by it. Best effort."""
    try:
        from shardserve.runtime.ray_private import kv_put

        context = serve.get_replica_context()
        kv_put(STARTUP_KEY.format(app=context.app_name, deployment=context.deployment,
                                  replica=context.replica_id.unique_id), json.dumps(startup).encode())
    except Exception as exc:
        logger.warning("replica start-up not stored: %s", exc)


def replica_startups(app: str) -> dict[str, list[dict]]:
    """Per shard deployment of the index app `app`, the start-up of every replica it ever started
    (oldest first). Needs a Ray connection."""
    from shardserve.runtime.ray_private import kv_get, kv_list

    found: dict[str, list[dict]] = {}
    for key in kv_list(f"replica-start/{app}/"):
        deployment = key.split("/")[2]
        found.setdefault(deployment, []).append(json.loads(kv_get(key) or b"{}"))
    return {name: sorted(rows, key=lambda row: row.get("ready_at", 0)) for name, rows in found.items()}
