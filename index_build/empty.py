"""A collection's first index: empty, flat, one shard, with its metadata columns, published the way
every build is (index_build.publish), so that the write log, replicas' deltas, filters, the point
API and compaction serve it as any index. It is searched exactly until it grows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from index_build.publish import BuildParams, publish_build, write_shard
from shardserve.collection.spec import CollectionSpec
from shardserve.index.indexes import index_from_bytes
from shardserve.index.manifest import DatasetInfo, Manifest
from shardserve.index.metadata import write_metadata
from shardserve.index.storage import Location
from shardserve.writes.log import WRITE_LOG, WriteLog
from shardserve.writes.roll import metadata_schema

EXACT = "Flat"  # while small: every search compares the query with every point


def create_empty(directory: Path, spec: CollectionSpec) -> Manifest:
    """Publish `spec`'s empty exact index in `directory` (a new directory)."""
    location = Location.parse(str(directory))
    schema = metadata_schema(spec.metadata) if spec.metadata else None
    dataset = DatasetInfo(name=f"collection:{spec.name}", fingerprint="empty",
                          metadata_columns=list(spec.metadata), metadata_kinds=dict(spec.metadata))

    def add(empty: bytes, partition, target: Location, timings: dict):
        shards = [write_shard(target, shard, index_from_bytes(empty)) for shard in range(partition.shards)]
        metadata = None if schema is None else [
            write_metadata(target, shard, np.zeros(0, np.int64), schema.empty_table())
            for shard in range(partition.shards)]
        return shards, metadata

    manifest = publish_build(location, BuildParams(EXACT, 1, spec.metric), dataset, spec.dim, 0,
                             lambda: np.zeros((0, spec.dim), np.float32), add, {"collection": spec.name})
    WriteLog(directory / WRITE_LOG).close()  # made with it: writes never make it (or its directory) again
    return manifest
