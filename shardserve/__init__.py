"""shardserve: distributed vector search on Ray (Ray Data builds sharded FAISS indexes, Ray Serve runs
one deployment per shard behind a fan-out router).

This package is the shared plain-Python layer every stage builds on, and the client users import:

    from shardserve import Client
    Client("http://127.0.0.1:8000").search(vector, k=10)

Subpackages, by concern: `data` (datasets, exact ground truth), `index` (index format: storage,
manifest, FAISS indexes, partitioning, metadata), `query` (the query path: HTTP contract, batching,
fan-out, the one top-k merge, shard search), `transport` (the router's HTTP door, shard links and
their wire format), `runtime` (Ray sessions, processes, ports).
"""

from shardserve.client import ApiError, AsyncClient, Client, Hits, Point

__all__ = ["ApiError", "AsyncClient", "Client", "Hits", "Point"]
