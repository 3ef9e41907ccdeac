"""App builder: `import_path: deployments.app:build_app` in a Serve config points here."""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppArgs
from deployments.router import Router
from deployments.shard import ShardDeployment
from index_build.manifest import read_manifest
from index_build.storage import Location


def build_app(args: dict) -> Application:
    """One deployment per shard (named like the shard, own replicas) bound into the router ingress."""
    app_args = AppArgs.model_validate(args)
    manifest = read_manifest(Location.parse(app_args.index))  # fail here, not in every replica
    scaling = ({"autoscaling_config": app_args.shard_autoscaling} if app_args.shard_autoscaling
               else {"num_replicas": app_args.replicas_per_shard})
    shards = [
        ShardDeployment.options(
            name=entry.name, **scaling,
            max_ongoing_requests=app_args.shard_max_ongoing_requests,
            ray_actor_options={"num_cpus": app_args.shard_num_cpus},
        ).bind(app_args.index, position, app_args.faiss_threads,
               app_args.debug_load_delay_s.get(entry.name, 0.0),
               app_args.debug_search_delay_s.get(entry.name, 0.0))
        for position, entry in enumerate(manifest.shards)
    ]
    return Router.options(
        num_replicas=app_args.router_replicas,
        max_ongoing_requests=app_args.router_max_ongoing_requests,
        max_queued_requests=app_args.router_max_queued_requests,
        ray_actor_options={"num_cpus": app_args.router_num_cpus},
    ).bind(shards, app_args.model_dump())
