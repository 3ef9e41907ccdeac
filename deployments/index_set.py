"""One index version as a router sees it: its manifest, a Serve handle and a shard link per shard,
and the coarse quantizer that IVF batches run once in the router."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import faiss
import numpy as np
import pyarrow as pa
from ray.serve.handle import DeploymentHandle

from deployments.config import EMBEDDER, INDEX_INGRESS
from deployments.metrics import RouterMetrics
from deployments.shard_calls import call_shard, shard_handle
from shardserve.index.assigner import CoarseAssigner, FilterShares
from shardserve.index.indexes import BLAS_MIN_ROWS, flat_search_with_blas_from, supported_params
from shardserve.index.manifest import Manifest, read_manifest
from shardserve.index.metadata import combine
from shardserve.index.storage import Location
from shardserve.query.api import ParsedQuery
from shardserve.query.fanout import Prepare, ShardCall, hedged, plain_query, search_batch
from shardserve.query.merge import QueryResult
from shardserve.query.render import real_ids
from shardserve.runtime.ray_private import deployment_handle_unchecked
from shardserve.transport.shard_link import ShardLinks
from shardserve.transport.shard_wire import ShardQuery, decode_answer
from shardserve.writes.locate import LogAddress, log_address
from shardserve.writes.points import PointsQuery, ScrollQuery, page, picked, rendered
from shardserve.writes.roll import gathered

logger = logging.getLogger("ray.serve")
# Batches up to this many rows are assigned on the event loop: a hand-off to the quantizer thread
# and back costs more than the assignment itself.
INLINE_QUANTIZE_ROWS = 32
LINK_REFRESH_S = 1.0  # how soon a router uses a new shard replica's link (Serve calls meanwhile)


@dataclass(frozen=True)
class IndexSet:
    """A request is answered by exactly one of these, even while a swap replaces it."""

    generation: int
    app: str
    manifest: Manifest
    shards: list[DeploymentHandle]  # with the shard-call options (deployments.shard_calls)
    supported: frozenset[str]
    assigner: CoarseAssigner | None  # IVF: the coarse quantizer, run once per batch in the router
    links: ShardLinks | None  # a TCP link per shard replica (None: Serve handle calls only)
    directory: DeploymentHandle  # the version's ingress: where each shard replica listens
    filter_shares: FilterShares  # each filter's share of every shard's rows: the lists to rank
    log: LogAddress | None  # its index's write log: writes go where this version's shards read
    embedder: DeploymentHandle | None  # an index built from text: its model's replicas

    @classmethod
    async def load(cls, generation: int, index: str, app: str, use_links: bool) -> IndexSet:
        """Files are read in a thread; handles are made on the replica's event loop (Serve's
        throughput-optimised handles refuse to be set up outside it)."""
        manifest, assigner, supported, log = await asyncio.to_thread(cls._read, index)
        flat_search_with_blas_from(BLAS_MIN_ROWS, manifest.dim)  # the quantizer's 16-25 row batches
        shards = [shard_handle(deployment_handle_unchecked(s.name, app)) for s in manifest.shards]
        directory = deployment_handle_unchecked(INDEX_INGRESS, app)
        embedder = None if manifest.embedder is None else deployment_handle_unchecked(EMBEDDER, app)
        loaded = cls(generation, app, manifest, shards, supported, assigner,
                     ShardLinks(len(shards)) if use_links else None, directory,
                     FilterShares([shard.num_vectors for shard in manifest.shards]), log, embedder)
        await loaded.refresh_links(timeout_s=2.0)
        return loaded

    async def refresh_links(self, timeout_s: float = 5.0) -> None:
        """Follow the directory (replicas started, moved or gone). Best effort: a shard without a
        link is called through Serve."""
        if self.links is None:
            return
        try:
            found = await asyncio.wait_for(self.directory.endpoints.remote(), timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.info("shard link directory of %s not reachable: %s", self.app, exc)
            return
        if found["secret"] is not None:
            self.links.update(found["endpoints"], bytes.fromhex(found["secret"]))

    async def call(self, shard: int, query: ShardQuery) -> tuple[np.ndarray, np.ndarray, float, int, int]:
        """One shard call: over the shard's link when one is up, else (or if it breaks) Serve."""
        link = self.links.pick(shard) if self.links is not None else None
        if link is not None and self.links is not None:
            try:
                return decode_answer(await link.call(query.encode()))
            except ConnectionError:
                self.links.drop(shard, link)
        return await call_shard(self.shards[shard], query)

    def search(self, queries: list[ParsedQuery], executor: Executor, timeout_s: float, hedge_after_s: float,
               metrics: RouterMetrics) -> Awaitable[list[QueryResult]]:
        """One batch of this version's queries: IVF lists assigned once here (small batches on the
        event loop, larger ones in `executor`), then one call per shard, hedged after
        `hedge_after_s` when that is set."""
        call: ShardCall = self.call
        if hedge_after_s:
            call = hedged(call, hedge_after_s, metrics.hedged.inc)
        prepare: Prepare = plain_query
        if self.assigner is not None:
            assigner, loop = self.assigner, asyncio.get_running_loop()

            async def prepare(matrix: np.ndarray, k: int, params: dict) -> ShardQuery:
                if len(matrix) <= INLINE_QUANTIZE_ROWS:
                    faiss.omp_set_num_threads(1)  # per thread: this is the loop's thread
                    return assigner.query(matrix, k, params, shares)
                return await loop.run_in_executor(executor, assigner.query, matrix, k, params, shares)
        shares = self.filter_shares
        return search_batch(queries, call, len(self.shards), self.manifest.metric != "l2", timeout_s,
                            metrics.shard_done, prepare, shares.learn)

    async def shard_infos(self, timeout_s: float) -> list[dict]:
        return await asyncio.wait_for(asyncio.gather(*[s.info.remote() for s in self.shards]), timeout_s)

    async def metadata(self, query: ParsedQuery, result: QueryResult,
                       timeout_s: float) -> list[list[dict]] | None:
        """The `include` columns of every hit the response carries, per query (None: no `include`).
        Fetched after the merge, for the final top-k only: every shard is asked for the ids (each
        holds its own rows' metadata, index.metadata), through Serve: a side path, not the search hop."""
        if not query.include:
            return None
        per_query = real_ids(result)
        wanted = sorted({int(i) for ids in per_query for i in ids})
        answers = await self._each_shard("metadata", timeout_s, wanted, list(query.include))
        found = combine(answers, len(wanted))
        by_id = dict(zip(wanted, found, strict=True))
        return [[by_id[int(i)] or {} for i in ids] for ids in per_query]

    async def ids_matching(self, where: str, limit: int,
                           timeout_s: float) -> tuple[list[tuple[np.ndarray, int]], int, pa.Schema | None]:
        """(each shard's live ids that pass a checked filter and the log position it found them at;
        how many in all; the arrow schema the shards hold metadata in) through Serve (a side path,
        like `metadata`). Over `limit` in all: no ids, the count only (a shard over it sends its
        count alone)."""
        return gathered(await self._each_shard("ids_matching", timeout_s, where, limit), limit)

    async def _each_shard(self, method: str, timeout_s: float, *args: object) -> list:
        """`method(*args)` on a replica of every shard, through Serve (a side path, as `metadata`)."""
        calls = [handle.options(method_name=method, request_serialization="cloudpickle",
                                response_serialization="cloudpickle").remote(*args)
                 for handle in self.shards]
        return list(await asyncio.wait_for(asyncio.gather(*calls), timeout_s))

    async def points(self, query: PointsQuery, timeout_s: float) -> list[dict]:
        """A get by ids: the points held, in the order asked (shardserve.writes.points)."""
        ids = list(query.ids)
        found, vectors = picked(await self._each_shard("points", timeout_s, ids, list(query.include),
                                                       query.vectors), len(ids))
        return rendered(ids, found, vectors, query.vectors)

    async def scroll(self, query: ScrollQuery, timeout_s: float) -> tuple[list[dict], int | None]:
        """A scroll page: its points, and the cursor of the next page (None: this was the last)."""
        ids, more = page(await self._each_shard("scroll", timeout_s, query.after, query.limit + 1,
                                                query.filter), query.limit)
        if not len(ids):
            return [], None
        points = await self.points(PointsQuery(tuple(ids.tolist()), query.include, query.vectors), timeout_s)
        return points, int(ids[-1]) if more else None

    async def count(self, where: str | None, timeout_s: float) -> int:
        return sum(await self._each_shard("count", timeout_s, where))

    def link_counts(self) -> list[int]:
        """Replicas reached over a link, per shard (0: that shard is called through Serve)."""
        return self.links.count() if self.links is not None else [0] * len(self.shards)

    @staticmethod
    def _read(index: str) -> tuple[Manifest, CoarseAssigner | None, frozenset[str], LogAddress | None]:
        location = Location.parse(index)
        manifest = read_manifest(location)
        return (manifest, CoarseAssigner.load(location, manifest),
                frozenset(supported_params(manifest.index_factory, manifest.dim, manifest.metric)),
                log_address(index))


async def follow_links(active: Callable[[], IndexSet], gauge) -> None:
    """Keep the served version's shard links in step with its replicas (once a second); `active`
    is read each time, so a swap's new version is followed from its next round."""
    while True:
        await asyncio.sleep(LINK_REFRESH_S)
        await active().refresh_links()
        gauge.set(sum(active().link_counts()))
