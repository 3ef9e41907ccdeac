"""The user's metadata columns (a caption, a URL, ...), stored per shard beside its index file and
fetched only for the final top-k after the merge.

Why per shard, in parquet: a shard's metadata lives where its vectors live (the shard's replicas
hold it, the router holds none of it, however large the index grows), in a columnar file any
pyarrow filesystem stores. Rows are sorted by id, so a lookup is a binary search, not a scan.
Plain pyarrow/numpy: tested without Ray.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardserve.errors import ShardserveError
from shardserve.index.manifest import ShardEntry
from shardserve.index.storage import Location, sha256_hex

ID = "id"


def metadata_file_name(shard: int) -> str:
    return f"shard-{shard:03d}.meta.parquet"


def write_metadata(location: Location, shard: int, ids: np.ndarray, table: pa.Table) -> ShardEntry:
    """One shard's metadata rows (aligned with `ids`), sorted by id, written and read back; its
    manifest entry carries the sha256 of what is stored."""
    order = np.argsort(ids, kind="stable")
    sorted_table = table.take(pa.array(order)).add_column(0, ID, pa.array(ids[order], pa.int64()))
    sink = io.BytesIO()
    pq.write_table(sorted_table, sink)
    data = sink.getvalue()
    name = metadata_file_name(shard)
    location.write_bytes(name, data)
    if location.read_bytes(name) != data:
        raise ShardserveError(f"metadata {name}: read-back differs from what was written")
    return ShardEntry(name=name.removesuffix(".parquet"), path=name, num_vectors=len(ids),
                      sha256=sha256_hex(data), bytes=len(data))


def column_kinds(schema: pa.Schema) -> dict[str, str]:
    """"number", "string" or "bool" per metadata column (what a filter value must be)."""
    kinds = {}
    for field in schema:
        if pa.types.is_boolean(field.type):
            kinds[field.name] = "bool"
        elif pa.types.is_integer(field.type) or pa.types.is_floating(field.type):
            kinds[field.name] = "number"
        elif pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
            kinds[field.name] = "string"
    return kinds


class MetadataTable:
    """One shard's metadata, looked up by id."""

    def __init__(self, table: pa.Table):
        self.ids = table.column(ID).to_numpy()
        self.table = table.drop_columns([ID])

    @classmethod
    def load(cls, location: Location, entry: ShardEntry) -> MetadataTable:
        from shardserve.index.manifest import read_shard_checked

        return cls(pq.read_table(pa.BufferReader(read_shard_checked(location, entry))))

    def lookup(self, ids: list[int], columns: list[str]) -> list[dict | None]:
        """Per id, its `columns` (None: the id is not in this shard)."""
        wanted = np.asarray(ids, dtype=np.int64)
        position = np.clip(np.searchsorted(self.ids, wanted), 0, max(len(self.ids) - 1, 0))
        found = (self.ids[position] == wanted) if len(self.ids) else np.zeros(len(wanted), bool)
        rows = self.table.select(columns).take(pa.array(position[found])).to_pylist()
        answers: list[dict | None] = [None] * len(wanted)
        for slot, row in zip(np.flatnonzero(found).tolist(), rows, strict=True):
            answers[slot] = row
        return answers


def combine(per_shard: list[list[dict | None]], count: int) -> list[dict | None]:
    """Each id lives in exactly one shard: take, per id, the shard that had it."""
    combined: list[dict | None] = [None] * count
    for answers in per_shard:
        for slot, row in enumerate(answers):
            if row is not None:
                combined[slot] = row
    return combined
