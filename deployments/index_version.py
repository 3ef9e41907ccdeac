"""One index version = one Serve application: a deployment per shard plus a small ingress.

Versions live in their own applications so that a new one can be deployed beside the serving one,
checked, switched to, and the old one deleted as a whole (`shardserve swap`). The ingress is not on
the query path (routers call the shard deployments directly); it answers readiness and the swap's
recall gate, with the same fan-out and merge code as the router, and it keeps the directory of
shard links (where each shard replica listens; shardserve.transport.shard_link).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from deployments.autoscaling import with_link_policy
from deployments.config import EMBEDDER, AppArgs
from deployments.embedder import EmbedderDeployment
from deployments.shard import ShardDeployment
from deployments.shard_calls import call_shard, shard_handle
from shardserve.errors import ServingError
from shardserve.index.assigner import CoarseAssigner
from shardserve.index.indexes import prepare_vectors
from shardserve.index.manifest import Manifest, Published, read_manifest
from shardserve.index.storage import Location
from shardserve.query.api import ParsedQuery
from shardserve.query.fanout import plain_query, search_batch
from shardserve.transport.shard_link import EndpointDirectory, new_secret
from shardserve.transport.shard_wire import ShardQuery


# Not on the query path: nothing to drain, so do not hold a swap up for the default 20 s.
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64, graceful_shutdown_timeout_s=2)
class IndexVersion:
    """Readiness, gate searches and the shard-link directory of one index version (not on the
    query path: routers read the directory once a second)."""

    def __init__(self, shards: list[DeploymentHandle], index: str, shard_timeout_s: float,
                 link_secret: str | None = None, embedder: DeploymentHandle | None = None):
        location = Location.parse(index)
        self.manifest = read_manifest(location)
        self.shards = shards
        self.calls = [shard_handle(shard) for shard in shards]
        self.assigner = CoarseAssigner.load(location, self.manifest)
        self.shard_timeout_s = shard_timeout_s
        self.directory = EndpointDirectory(len(shards))
        self.link_secret = link_secret
        self.embedder = embedder  # an index built from text: routers call it by name

    def announce(self, shard: int, replica: str, host: str, port: int) -> None:
        self.directory.announce(shard, replica, host, port)

    def withdraw(self, shard: int, replica: str) -> None:
        """A replica that stops: routers drop its link at their next look (within a second)."""
        self.directory.withdraw(shard, replica)

    def endpoints(self) -> dict:
        """Per shard, where its live replicas listen, and the secret their links want (routers
        poll this)."""
        return {"secret": self.link_secret, "endpoints": self.directory.endpoints()}

    async def info(self) -> dict:
        """The manifest's version and each shard's (raises until every shard is loaded)."""
        infos = await asyncio.gather(*[shard.info.remote() for shard in self.shards])
        return {"index_version": self.manifest.index_version, "dim": self.manifest.dim,
                "metric": self.manifest.metric, "shards": infos}

    async def search(self, matrix: np.ndarray, k: int, params: dict) -> np.ndarray:
        """Merged top-k ids of every shard, as the router computes them; shards must all answer."""
        query = ParsedQuery(matrix=prepare_vectors(matrix, self.manifest.metric), k=k,
                            params=tuple(sorted(params.items())), single=False, require_full=True)

        async def call(shard: int, shard_query: ShardQuery):
            return await call_shard(self.calls[shard], shard_query)

        assigner = self.assigner

        async def prepare(m: np.ndarray, kk: int, p: dict) -> ShardQuery:
            assert assigner is not None  # used only when there is one
            return await asyncio.to_thread(assigner.query, m, kk, p)

        [result] = await search_batch([query], call, len(self.shards), self.manifest.metric != "l2",
                                      self.shard_timeout_s * 10,
                                      prepare=prepare if self.assigner else plain_query)
        if result.answered != result.shards:
            raise ServingError(f"only {result.answered} of {result.shards} shards answered")
        return result.ids


def build_index_app(args: dict) -> Application:
    """The shard deployments of `args['index']` (named like the shards) bound into their ingress
    (a Serve app builder: exactly one argument)."""
    return index_app(args)


def index_app(args: dict, shard_class: type | None = None, published: Published | None = None) -> Application:
    """build_index_app; `shard_class`, a subclass of ShardDeployment's class, replaces it (the
    tests inject faults so); `published`: the index as the caller already opened it."""
    app_args = AppArgs.model_validate(args)
    # Bound to the version published now, in its immutable directory (fails here, not per replica).
    published = published or Published.open(app_args.index)
    app_args = app_args.model_copy(update={"index": published.version.uri})
    manifest = published.manifest
    link = app_args.shard_transport == "link"
    # One secret per build of this app: its shards demand it, its directory hands it to routers
    # (inside Ray, over its authenticated RPC); nothing outside Ray ever sees it.
    secret = new_secret() if link else None
    scaling = ({"autoscaling_config": with_link_policy(app_args.shard_autoscaling) if link
                else app_args.shard_autoscaling} if app_args.shard_autoscaling
               else {"num_replicas": app_args.replicas_per_shard})
    actor_options: dict = {"num_cpus": app_args.shard_num_cpus}
    if app_args.shard_resources:
        actor_options["resources"] = dict(app_args.shard_resources)
    shard: Any = (ShardDeployment if shard_class is None
                  else ShardDeployment.options(func_or_class=shard_class))  # type: ignore[attr-defined]
    shards = [
        shard.options(
            name=entry.name, **scaling,
            max_ongoing_requests=app_args.shard_max_ongoing_requests,
            ray_actor_options=actor_options, logging_config={"enable_access_log": False},
        ).bind(app_args.index, position, faiss_threads=app_args.faiss_threads, link_secret=secret,
               index_version=manifest.index_version, nice=app_args.serving_nice, mmap=app_args.shard_mmap,
               warm_workers=app_args.warm_workers, max_rows=app_args.max_vectors + app_args.max_batch_size,
               max_k=app_args.max_k, max_frame=app_args.max_body_bytes,
               trace_endpoint=app_args.trace_endpoint, trace_ratio=app_args.trace_ratio)
        for position, entry in enumerate(manifest.shards)
    ]
    embedder = None if manifest.embedder is None else embedder_deployment(app_args, manifest)
    return IndexVersion.bind(shards, app_args.index, app_args.shard_timeout_s, secret,  # type: ignore[attr-defined]
                             embedder)


def embedder_deployment(args: AppArgs, manifest: Manifest) -> Application:
    """The embedder of an index built from text: its own replicas (or autoscaling on its own
    queue), its own resources; the model found where `args.embedder` says, else by the name the
    manifest records (a known model), and refused unless its files hash to the manifest's identity."""
    assert manifest.embedder is not None
    model = args.embedder or manifest.embedder.name
    scaling = ({"autoscaling_config": args.embedder_autoscaling} if args.embedder_autoscaling
               else {"num_replicas": args.embedder_replicas})
    actor_options: dict = {"num_cpus": args.embedder_num_cpus}
    if args.embedder_resources:
        actor_options["resources"] = dict(args.embedder_resources)
    return EmbedderDeployment.options(  # type: ignore[attr-defined]
        name=EMBEDDER, **scaling, ray_actor_options=actor_options,
        logging_config={"enable_access_log": False},
    ).bind(model, manifest.embedder.model_dump(), max_batch_texts=args.embedder_max_batch,
           max_texts=args.max_texts, max_text_chars=args.max_text_chars, nice=args.serving_nice,
           providers=tuple(args.embedder_providers), idle=args.embedder_idle_priority,
           trace_endpoint=args.trace_endpoint, trace_ratio=args.trace_ratio)
