"""App builders: `import_path: deployments.app:build_app` (router) and
`deployments.index_version:build_index_app` (one index version's shards) in a Serve config."""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppArgs
from deployments.control import IndexControl
from deployments.index_version import build_index_app  # noqa: F401  (re-exported for configs)
from deployments.router import Router
from shardserve.index.manifest import Published

# No access-log line per request on the query path (router, shards): it costs CPU on every request
# of both; errors and warnings are still logged, and request metrics still flow.
HOT_PATH_LOGGING = {"enable_access_log": False}


def build_app(args: dict) -> Application:
    """The router ingress and the index pointer; the shards live in the index version's own app."""
    return router_app(args)


def router_app(args: dict, published: Published | None = None) -> Application:
    """build_app, for the index as its caller already opened it (`published`), else as `args` name it."""
    app_args = AppArgs.model_validate(args)
    # The version published now, in its immutable directory (fails here, not in every replica).
    published = published or Published.open(app_args.index)
    app_args = app_args.model_copy(update={"index": published.version.uri})
    pinned = {"resources": dict(app_args.router_resources)} if app_args.router_resources else {}
    control = IndexControl.options(ray_actor_options={"num_cpus": 0, **pinned}).bind(app_args.model_dump())  # type: ignore[attr-defined]
    scaling: dict = ({"autoscaling_config": app_args.router_autoscaling} if app_args.router_autoscaling
                     else {"num_replicas": app_args.router_replicas})
    if app_args.router_max_per_node is not None:
        scaling["max_replicas_per_node"] = app_args.router_max_per_node
    return Router.options(  # type: ignore[attr-defined]
        **scaling,
        max_ongoing_requests=app_args.router_max_ongoing_requests,
        max_queued_requests=app_args.router_max_queued_requests,
        ray_actor_options={"num_cpus": app_args.router_num_cpus, **pinned},
        logging_config=HOT_PATH_LOGGING,
    ).bind(control, app_args.model_dump())
