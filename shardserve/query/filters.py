"""Metadata filters in Chroma's `where` syntax: checked and put in one canonical form in the router,
evaluated in each shard over its own metadata (pyarrow.compute) into the ids FAISS may return.

    {"label": 3}                                   equality, shorthand for {"label": {"$eq": 3}}
    {"label": {"$in": [1, 3]}}                     $eq $ne $gt $gte $lt $lte $in $nin
    {"$and": [{"year": {"$gte": 2020}}, {"lang": {"$ne": "de"}}]}   also $or
    {"$id": {"$in": [12, 7]}}                      the ids answers carry

A filter is refused (422 naming `filter`) for an unknown column or operator, a value of the wrong type
or outside the column's integer type, nesting deeper than MAX_DEPTH, an `$in` longer than MAX_IN,
more than MAX_LEAVES comparisons or MAX_VALUES values, a canonical form over MAX_FILTER_BYTES, more work than
MAX_FILTER_WORK, or an index built without metadata. The router refuses before any shard sees it:
a shard cannot stop a pass over its rows once it started, and every shard would run it.
A row whose value is missing (null) matches no comparison on that column, `$ne` and `$nin` included.

Integer columns compare as integers, exactly, on every path: a float64 holds integers exactly only
up to 2^53, and ids, hashes or timestamps go past it (two values one apart would compare equal).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from shardserve.index.metadata import FLOAT_KINDS, INTEGER_KINDS, Postings
from shardserve.query.api import ApiError
from shardserve.query.cache import ByteBoundedCache
from shardserve.transport.shard_wire import MAX_FILTER_BYTES

COMPARISONS = {"$eq": pc.equal, "$ne": pc.not_equal, "$gt": pc.greater, "$gte": pc.greater_equal,
               "$lt": pc.less, "$lte": pc.less_equal}
MEMBERSHIP = ("$in", "$nin")
MAX_DEPTH = 8
MAX_IN = 4096
# Every comparison is a pass over a shard's rows (or a posting-list lookup): its work is the rows of
# the largest shard times the comparisons, bounded before any shard starts.
MAX_LEAVES = 256
MAX_VALUES = 2 * MAX_IN  # values in all of a filter's comparisons ($in lists included)
# comparisons x rows of the largest shard; an $in value counts as 1/IN_VALUES_PER_PASS of a pass
MAX_FILTER_WORK = 1 << 25
IN_VALUES_PER_PASS = 16
EXACT_FLOAT = 2**53  # a float beyond this is not an exact integer
ID = "$id"
ID_KIND = "int64"  # user ids, as stored


def _refuse(message: str) -> ApiError:
    return ApiError(422, "filter", f"filter: {message}")


def _shown(value: object) -> str:
    return f"{type(value).__name__} {str(value)[:40]!r}"


def _integer(value: object, kind: str, op: str, where: str) -> int:
    """`value` as an integer of column type `kind`: exact, inside the type's range. A non-integral
    bound of a range becomes the integer bound that selects the same rows."""
    if isinstance(value, float) and math.isfinite(value) and abs(value) <= EXACT_FLOAT:
        if value != int(value):
            if op not in ("$gt", "$gte", "$lt", "$lte"):
                raise _refuse(f"{where} needs an integer ({kind} column), got {_shown(value)}")
            value = math.floor(value) if op in ("$gt", "$lte") else math.ceil(value)
        value = int(value)
    if isinstance(value, float):
        raise _refuse(f"{where} needs an exact integer ({kind} column: past 2^53 send a JSON integer, "
                      f"not a float), got {_shown(value)}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise _refuse(f"{where} needs an integer ({kind} column), got {_shown(value)}")
    low, high = INTEGER_KINDS[kind]
    if not low <= value <= high:
        raise _refuse(f"{where} = {value} is outside the {kind} column's range [{low}, {high}]")
    return value


def _value(value: object, kind: str, op: str, where: str) -> object:
    """A filter value checked against its column's kind, in its canonical spelling."""
    if kind in INTEGER_KINDS:
        return _integer(value, kind, op, where)
    if kind in FLOAT_KINDS and isinstance(value, (int, float)) and not isinstance(value, bool):
        if math.isfinite(value) and abs(value) < 1e308:
            return float(value) + 0.0  # -0.0 is 0.0: one spelling, one cache entry
    elif (kind, type(value)) in (("string", str), ("bool", bool)):
        return value
    raise _refuse(f"{where} needs a {kind}, got {_shown(value)}")


class _Count:
    """What a filter asks for so far, checked as it is walked: a filter past a bound is refused
    before the rest of it costs the router anything."""

    def __init__(self) -> None:
        self.leaves = 0
        self.values = 0
        self.bytes = 0

    def leaf(self) -> None:
        self.leaves += 1
        if self.leaves > MAX_LEAVES:
            raise _refuse(f"more than {MAX_LEAVES} comparisons: match a set with $in instead")

    def add(self, values: list) -> None:
        self.values += len(values)
        if self.values > MAX_VALUES:
            raise _refuse(f"more than {MAX_VALUES} values in all")
        self.bytes += sum(len(v) if isinstance(v, str) else 8 for v in values)
        if self.bytes > MAX_FILTER_BYTES:
            raise _refuse(f"more than {MAX_FILTER_BYTES} bytes of values")

    def work(self) -> float:
        """Passes over a shard's rows, about: one per comparison, and a fraction per $in value."""
        return self.leaves + self.values / IN_VALUES_PER_PASS


def _comparison(key: str, value: object, kind: str, where: str, count: _Count) -> dict:
    if not isinstance(value, dict):
        count.add([value])
        return {key: {"$eq": _value(value, kind, "$eq", where)}}
    if len(value) != 1:
        raise _refuse(f"{where} takes one operator, got {sorted(value)}")
    [(op, operand)] = value.items()
    if op in MEMBERSHIP:
        if not isinstance(operand, list) or not 1 <= len(operand) <= MAX_IN:
            raise _refuse(f"{where}.{op} needs a list of 1 to {MAX_IN} values")
        count.add(operand)
        values = {_value(item, kind, op, f"{where}.{op}") for item in operand}
        return {key: {op: sorted(values)}}  # one spelling per set: order and repeats do not matter
    if op in COMPARISONS:
        if op not in ("$eq", "$ne") and kind == "bool":
            raise _refuse(f"{where}.{op} does not order booleans")
        count.add([operand])
        return {key: {op: _value(operand, kind, op, f"{where}.{op}")}}
    raise _refuse(f"unknown operator {op!r} at {where} (use {sorted([*COMPARISONS, *MEMBERSHIP])})")


def _canonical(node: object, kinds: dict[str, str], depth: int, where: str, count: _Count) -> dict:
    if depth > MAX_DEPTH:
        raise _refuse(f"nested deeper than {MAX_DEPTH} at {where}")
    if not isinstance(node, dict) or not node:
        raise _refuse(f"{where} must be a non-empty object")
    canonical: dict = {}
    for key, value in node.items():
        if key in ("$and", "$or"):
            if not isinstance(value, list) or not value:
                raise _refuse(f"{where}.{key} must be a non-empty list of filters")
            children = {orjson.dumps(child, option=orjson.OPT_SORT_KEYS): child for child in
                        (_canonical(sub, kinds, depth + 1, f"{where}.{key}[{i}]", count)
                         for i, sub in enumerate(value))}
            canonical[key] = [children[text] for text in sorted(children)]
            continue
        if key.startswith("$") and key != ID:
            raise _refuse(f"unknown operator {key!r} at {where} (use $and, $or, or a column)")
        if key != ID and key not in kinds:
            raise _refuse(f"unknown column {key!r} (filterable: {sorted(kinds)})")
        count.leaf()
        canonical.update(_comparison(key, value, ID_KIND if key == ID else kinds[key], f"{where}.{key}",
                                     count))
    return canonical


def check_filter(value: object, kinds: dict[str, str], rows: int = 0) -> str:
    """The filter in its canonical JSON (keys sorted, shorthands spelt out, `$in` sets sorted, numbers
    in their column's type: equal filters share a scan and a cache entry), once every column,
    operator and value is known to fit the index (`kinds`: column_kinds of its metadata) and its
    work (comparisons x `rows`, the largest shard's rows) is within MAX_FILTER_WORK."""
    if not kinds:
        raise _refuse("this index was built without metadata columns: nothing to filter on")
    count = _Count()
    canonical = orjson.dumps(_canonical(value, kinds, 1, "filter", count), option=orjson.OPT_SORT_KEYS)
    if len(canonical) > MAX_FILTER_BYTES:
        raise _refuse(f"{len(canonical)} bytes in canonical form, more than {MAX_FILTER_BYTES}")
    if count.work() * rows > MAX_FILTER_WORK:
        raise _refuse(f"{count.leaves} comparisons and {count.values} values over {rows} rows per shard "
                      f"are more work than {MAX_FILTER_WORK} row passes: use fewer comparisons")
    return canonical.decode()


def _listed(rows: int, lists: list[np.ndarray]) -> np.ndarray:
    mask = np.zeros(rows, bool)
    for listed in lists:
        mask[listed] = True
    return mask


def _operands(column: pa.ChunkedArray, operands: list) -> tuple[pa.ChunkedArray, pa.Array]:
    """(column, values) in one type to compare in: an integer column with integers in its own type,
    exactly; other numbers as float64; anything else in the column's type."""
    kind = column.type
    if pa.types.is_integer(kind) and all(isinstance(v, int) for v in operands):
        return column, pa.array(operands, kind)  # the router checked each fits the type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):  # floats (or an older index's kinds)
        return pc.cast(column, pa.float64(), safe=False), pa.array(operands, pa.float64())
    return column, pa.array(operands, kind)


def _leaf(key: str, value: dict | object, table: pa.Table, ids: np.ndarray, postings: Postings | None
          ) -> np.ndarray:
    op, operand = next(iter(value.items())) if isinstance(value, dict) else ("$eq", value)
    operands: list = operand if op in MEMBERSHIP else [operand]  # type: ignore[assignment]
    if postings is not None and key in postings.columns and op in ("$eq", "$ne", *MEMBERSHIP):
        # the build's posting lists: a lookup per value, no pass over the column
        part = _listed(len(ids), [postings.rows(key, v) for v in operands])
        if op in ("$ne", "$nin"):  # a missing value matches no comparison, as in the scan
            part = ~part & ~_listed(len(ids), [postings.rows(key, None)])
        return part
    if key == ID:
        column, values = pa.array(ids, pa.int64()), pa.array(operands, pa.int64())
    else:
        column, values = _operands(table.column(key), operands)
    if op in MEMBERSHIP:
        hit = pc.is_in(column, value_set=values)
        if op == "$nin":  # a missing value is in no set and out of none, as with $ne (SQL's NOT IN)
            hit = pc.and_(pc.invert(hit), pc.is_valid(column))
    else:
        hit = COMPARISONS[op](column, values[0])
    return np.asarray(pc.fill_null(hit, False))


def _mask(node: dict, table: pa.Table, ids: np.ndarray, postings: Postings | None) -> np.ndarray:
    result = np.ones(len(ids), bool)
    for key, value in node.items():
        if key == "$and":
            for sub in value:
                result &= _mask(sub, table, ids, postings)
        elif key == "$or":  # one mask at a time: memory stays two masks, however many children
            either = np.zeros(len(ids), bool)
            for sub in value:
                either |= _mask(sub, table, ids, postings)
            result &= either
        else:
            result &= _leaf(key, value, table, ids, postings)
    return result


# Parsed filters, kept by their canonical JSON for the next batches; bounded by bytes (a parsed
# filter holds about 16 bytes of Python objects per byte of JSON), not by count.
_PARSED = ByteBoundedCache(64 << 20)


def _parsed(filter_json: str) -> dict:
    parsed = _PARSED.get(filter_json)
    if parsed is None:
        parsed = orjson.loads(filter_json)
        _PARSED.put(filter_json, parsed, 16 * len(filter_json))
    return parsed


class Among(str):
    """A filter given in-process as the ids it passes (Chroma's API evaluates its own `where`, then
    searches among the ids found): a string, so the shards' caches (matching rows, selectors,
    gathered vectors) key it as they key a filter, by `among:<digest of the ids>`, while `matching`
    reads its `ids` instead of parsing it. Never sent to another process; a plain string of its
    text (no client's: a checked filter is canonical JSON, `{...}`) is refused by `cache_key`
    before any cache is looked in."""

    ids: np.ndarray

    @classmethod
    def of(cls, ids: np.ndarray) -> Among:
        distinct = np.unique(np.asarray(ids, np.int64))
        made = cls("among:" + hashlib.blake2b(distinct.tobytes(), digest_size=16).hexdigest())
        made.ids = distinct
        return made


def cache_key(where: str) -> str:
    """`where` as the shards' caches key it: a checked filter, or an Among (a plain string of an
    Among's text is refused: it would find the entry an Among of other ids made)."""
    if where.startswith("among:") and not isinstance(where, Among):
        raise ApiError(422, "filter", "not a filter: the among: form is the server's own, in-process")
    return where


def filter_bytes(where: str) -> int:
    """What a cache entry keyed by `where` holds of it: its text, and an Among's ids."""
    return len(where) + (where.ids.nbytes if isinstance(where, Among) else 0)


def matching(filter_json: str, table: pa.Table, ids: np.ndarray, postings: Postings | None = None
             ) -> np.ndarray:
    """The ids (of `ids`, the table's rows) that pass a checked filter; equality and membership on a
    column with `postings` (built with the table, same row order) read its lists instead."""
    if isinstance(filter_json, Among):
        return ids[np.isin(ids, filter_json.ids)]
    return ids[_mask(_parsed(filter_json), table, ids, postings)]
