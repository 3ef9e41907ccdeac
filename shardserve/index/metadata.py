"""The user's metadata columns (a caption, a URL, ...), stored per shard beside its index file and
fetched only for the final top-k after the merge.

Why per shard, in parquet: a shard's metadata lives where its vectors live (the shard's replicas
hold it, the router holds none of it, however large the index grows), in a columnar file any
pyarrow filesystem stores. Rows are sorted by id, so a lookup is a binary search, not a scan.
Categorical columns (integers, strings, booleans with at most POSTING_VALUES distinct values) also
get posting lists at build time: per value, the rows that hold it (an inverted index, as Lucene
keeps one). An equality or `$in` filter on such a column then costs a lookup and a memset, not a
pass over the column (tests/test_filters.py checks both give the same rows; make bench-filter
records the cost of each). Row numbers, not a bitmap per value: a column's lists hold each row
once (4 bytes a row, however many values), where bitmaps would cost values x rows / 8.
Plain pyarrow/numpy: tested without Ray.
"""

from __future__ import annotations

import io

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardserve.errors import ShardserveError
from shardserve.index.manifest import MetadataEntry, ShardEntry
from shardserve.index.storage import Location, sha256_hex

ID = "id"
# A filter value on an integer column must fit the column's type (the router refuses it otherwise).
INTEGER_KINDS = {f"int{bits}": (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) for bits in (8, 16, 32, 64)} | {
    f"uint{bits}": (0, (1 << bits) - 1) for bits in (8, 16, 32, 64)}
EXACT_FLOAT = 2**53  # float64 holds every integer up to here, and not all beyond
FLOAT_KINDS = ("number", "float32", "float16")  # the kinds of float columns (column_kinds)
# Past these a narrow float column would store infinity.
FLOAT_MAX = {"float32": float(np.finfo(np.float32).max), "float16": float(np.finfo(np.float16).max)}
POSTING_VALUES = 4096  # a column with more distinct values than this is scanned, not inverted


def metadata_file_name(shard: int) -> str:
    return f"shard-{shard:03d}.meta.parquet"


def postings_file_name(shard: int) -> str:
    return f"shard-{shard:03d}.postings.parquet"


def _write_checked(location: Location, name: str, table: pa.Table, rows: int) -> ShardEntry:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    data = sink.getvalue()
    location.write_bytes(name, data)
    if location.read_bytes(name) != data:
        raise ShardserveError(f"metadata {name}: read-back differs from what was written")
    return ShardEntry(name=name.removesuffix(".parquet"), path=name, num_vectors=rows,
                      sha256=sha256_hex(data), bytes=len(data))


def write_metadata(location: Location, shard: int, ids: np.ndarray, table: pa.Table) -> MetadataEntry:
    """One shard's metadata rows (aligned with `ids`), sorted by id, and the posting lists of its
    categorical columns, each written and read back; the manifest entry carries their sha256."""
    order = np.argsort(ids, kind="stable")
    sorted_table = table.take(pa.array(order)).add_column(0, ID, pa.array(ids[order], pa.int64()))
    entry = _write_checked(location, metadata_file_name(shard), sorted_table, len(ids))
    lists = build_postings(sorted_table.drop_columns([ID]))
    postings = (_write_checked(location, postings_file_name(shard), lists, len(ids))
                if lists.num_rows else None)
    return MetadataEntry(**entry.model_dump(), postings=postings)


def posting_key(value: object) -> str:
    """The one spelling a value's posting list is stored and found under: integers as integers
    (exact at any size), an integral float as the integer it is, strings and booleans as JSON, a
    missing value as null."""
    if isinstance(value, float) and value.is_integer() and abs(value) < EXACT_FLOAT:
        value = int(value)
    return orjson.dumps(value).decode()


def build_postings(table: pa.Table) -> pa.Table:
    """(column, key, rows) per distinct value of each categorical column: the ascending row numbers
    of the table's rows that hold it (nulls under "null", so `$ne` can leave them out)."""
    columns: list[str] = []
    keys: list[str] = []
    lists: list[np.ndarray] = []
    for name in table.column_names:
        kind = table.column(name).type
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_boolean(kind)):
            continue  # floats are ranges, not categories: scanned
        encoded = pc.dictionary_encode(table.column(name)).combine_chunks()
        values = encoded.dictionary.to_pylist()
        if len(values) > POSTING_VALUES:
            continue
        codes = pc.fill_null(encoded.indices, len(values)).to_numpy(zero_copy_only=False)
        order = np.argsort(codes, kind="stable").astype(np.int32)  # rows ascending within a value
        bounds = np.searchsorted(codes[order], np.arange(len(values) + 2))
        for code, value in enumerate([*values, None]):
            if bounds[code + 1] > bounds[code]:
                columns.append(name)
                keys.append(posting_key(value))
                lists.append(order[bounds[code]:bounds[code + 1]])
    return pa.table({"column": pa.array(columns, pa.string()), "key": pa.array(keys, pa.string()),
                     "rows": pa.array(lists, pa.list_(pa.int32()))})


class Postings:
    """One shard's posting lists: the rows holding each value of its categorical columns."""

    def __init__(self, table: pa.Table):
        offsets = table.column("rows").combine_chunks()
        flat = offsets.flatten().to_numpy()
        bounds = offsets.offsets.to_numpy()
        self.lists: dict[tuple[str, str], np.ndarray] = {}
        inexact: set[str] = set()
        for i, (column, key) in enumerate(zip(table.column("column").to_pylist(),
                                              table.column("key").to_pylist(), strict=True)):
            stored = orjson.loads(key)
            if isinstance(stored, float) and not (stored.is_integer() and abs(stored) < EXACT_FLOAT):
                inexact.add(column)  # an older build keyed integers as float64: from 2^53, scan instead
            rekeyed = (column, posting_key(stored))
            if rekeyed in self.lists:  # two stored keys that are one value now: the lists are unsure
                inexact.add(column)
            self.lists[rekeyed] = flat[bounds[i]:bounds[i + 1]]
        self.columns = set(table.column("column").to_pylist()) - inexact

    def rows(self, column: str, value: object) -> np.ndarray:
        """The rows whose `column` equals `value` (none: a value no row holds)."""
        return self.lists.get((column, posting_key(value)), np.zeros(0, np.int32))


def column_kinds(schema: pa.Schema) -> dict[str, str]:
    """What a filter value must be, per metadata column: "bool", "string", "number" (a float64
    column), "float32" or "float16" (a written value must fit the column's range, or it would be
    stored as infinity), or the integer column's type ("int64", "uint8", ... in
    INTEGER_KINDS)."""
    kinds = {}
    for field in schema:
        if pa.types.is_boolean(field.type):
            kinds[field.name] = "bool"
        elif pa.types.is_integer(field.type):
            kinds[field.name] = str(field.type)
        elif pa.types.is_floating(field.type):
            kinds[field.name] = {16: "float16", 32: "float32"}.get(field.type.bit_width, "number")
        elif pa.types.is_string(field.type) or pa.types.is_large_string(field.type):
            kinds[field.name] = "string"
    return kinds


class MetadataTable:
    """One shard's metadata, looked up by id."""

    def __init__(self, table: pa.Table, postings: Postings | None = None):
        self.ids = table.column(ID).to_numpy()
        self.table = table.drop_columns([ID])
        self.postings = postings

    @classmethod
    def load(cls, location: Location, entry: ShardEntry) -> MetadataTable:
        from shardserve.index.manifest import read_shard_checked

        def read(part: ShardEntry) -> pa.Table:
            return pq.read_table(pa.BufferReader(read_shard_checked(location, part)))

        postings = entry.postings if isinstance(entry, MetadataEntry) else None
        return cls(read(entry), Postings(read(postings)) if postings else None)

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
