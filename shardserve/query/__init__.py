"""The query path: HTTP contract, batching, fan-out, the one top-k merge, shard search."""
