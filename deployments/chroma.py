"""Chroma's API in a router replica: shardserve.chroma.front, its native calls made in-process on
the replica's collections (deployments.collections), so a Chroma collection has every native
collection's path: checks, write log, folds, growth, serving apart, fairness."""

from __future__ import annotations

import orjson

from deployments.collections import CollectionsFront
from deployments.config import AppArgs
from shardserve.chroma.front import ChromaFront
from shardserve.chroma.records import Limits
from shardserve.query.api import ApiError
from shardserve.transport.http_front import JSON, Reply
from shardserve.transport.http_front import Request as HttpRequest

PREFIX = "/api/v2"


def chroma_front(collections: CollectionsFront, args: AppArgs) -> ChromaFront:
    async def native(method: str, route: str, body: object, reserved: bool = False) -> object:
        path = "/v1/collections" + (f"/{route}" if route else "")
        data = b"" if body is None else orjson.dumps(body)
        reply = await collections.respond(HttpRequest(method, path, data, "", JSON), path, reserved)
        answer = orjson.loads(reply.body) if reply.body else None
        if reply.status >= 300:
            message = answer.get("error") if isinstance(answer, dict) else None
            raise ApiError(reply.status, None, str(message or reply.body[:200]))
        return answer

    # one Chroma write is one native write (one log transaction: all or nothing)
    batch = min(args.chroma_max_batch, args.max_write_points)
    limits = Limits(args.max_page, args.max_write_points, args.max_k, args.max_vectors, batch)
    return ChromaFront(collections.root, native, limits, args.chroma_shards, args.chroma_allow_reset,
                       args.max_collections, args.chroma_grow_at, collections.search_among)


async def respond(front: ChromaFront, request: HttpRequest) -> Reply:
    status, body, headers = await front.respond(request.method, request.path[len(PREFIX):], request.query,
                                                request.body)
    return Reply(status, body, headers=headers)
