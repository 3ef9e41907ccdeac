"""How the router (and the swap gate) call a shard deployment: raw bytes through Serve's handle.

Requests and answers are `bytes` (shardserve.transport.shard_wire), so Serve's serializer only frames them:
plain `pickle` of a bytes object is a memcpy, where the default cloudpickle walks numpy objects.
"""

from __future__ import annotations

import asyncio

import numpy as np
from ray.serve.handle import DeploymentHandle

from shardserve.transport.shard_wire import ShardQuery, decode_answer

HOP_SERIALIZATION = "pickle"


def shard_handle(handle: DeploymentHandle) -> DeploymentHandle:
    """The handle options every shard call uses."""
    return handle.options(method_name="search", request_serialization=HOP_SERIALIZATION,
                          response_serialization=HOP_SERIALIZATION)


async def call_shard(handle: DeploymentHandle, query: ShardQuery
                     ) -> tuple[np.ndarray, np.ndarray, float, int, int]:
    """One awaited call; a cancelled caller (deadline) cancels the shard's request too."""
    response = handle.remote(query.encode())
    try:
        return decode_answer(await response)
    except asyncio.CancelledError:
        response.cancel()
        raise
