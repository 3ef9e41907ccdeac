"""A no-op Serve deployment: the framework's floor for `make bench` (same cluster, same ingress)."""

from __future__ import annotations

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

_BODY = b'{"ids":[],"distances":[],"timing_ms":{"total":0.0,"compute":0.0,"queue":0.0}}'


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.25})
class NoopDeployment:
    async def __call__(self, request: Request) -> Response:
        await request.body()
        return Response(_BODY, media_type="application/json")
