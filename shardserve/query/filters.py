"""Metadata filters in Chroma's `where` syntax: checked against the index's columns in the router,
evaluated in each shard over its own metadata (pyarrow.compute) into the ids FAISS may return.

    {"label": 3}                                   equality, shorthand for {"label": {"$eq": 3}}
    {"label": {"$in": [1, 3]}}                     $eq $ne $gt $gte $lt $lte $in $nin
    {"$and": [{"year": {"$gte": 2020}}, {"lang": {"$ne": "de"}}]}   also $or
    {"$id": {"$in": [12, 7]}}                      the ids answers carry

A filter is refused (422 naming `filter`) for an unknown column or operator, a value of the wrong type,
nesting deeper than MAX_DEPTH, an `$in` longer than MAX_IN, or an index built without metadata.
A row whose value is missing (null) matches no comparison on that column, `$ne` and `$nin` included.
"""

from __future__ import annotations

import functools

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from shardserve.index.metadata import Postings
from shardserve.query.api import ApiError

COMPARISONS = {"$eq": pc.equal, "$ne": pc.not_equal, "$gt": pc.greater, "$gte": pc.greater_equal,
               "$lt": pc.less, "$lte": pc.less_equal}
MEMBERSHIP = ("$in", "$nin")
MAX_DEPTH = 8
MAX_IN = 4096
ID = "$id"


def _refuse(message: str) -> ApiError:
    return ApiError(422, "filter", f"filter: {message}")


def _kind_of(value: object) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "number"  # an id is a number too, but a whole one (see _check_value)
    if isinstance(value, float):
        return "number" if np.isfinite(value) else None
    if isinstance(value, str):
        return "string"
    return None


def _check_value(value: object, kind: str, where: str) -> None:
    if kind == "id":
        if not isinstance(value, int) or isinstance(value, bool):
            raise _refuse(f"{where} needs an integer id, got {type(value).__name__} {str(value)[:40]!r}")
        return
    if _kind_of(value) != kind:
        raise _refuse(f"{where} needs a {kind}, got {type(value).__name__} {str(value)[:40]!r}")


def _check(node: object, kinds: dict[str, str], depth: int, where: str) -> None:
    if depth > MAX_DEPTH:
        raise _refuse(f"nested deeper than {MAX_DEPTH} at {where}")
    if not isinstance(node, dict) or not node:
        raise _refuse(f"{where} must be a non-empty object")
    for key, value in node.items():
        if key in ("$and", "$or"):
            if not isinstance(value, list) or not value:
                raise _refuse(f"{where}.{key} must be a non-empty list of filters")
            for position, sub in enumerate(value):
                _check(sub, kinds, depth + 1, f"{where}.{key}[{position}]")
            continue
        if key.startswith("$") and key != ID:
            raise _refuse(f"unknown operator {key!r} at {where} (use $and, $or, or a column)")
        if key != ID and key not in kinds:
            raise _refuse(f"unknown column {key!r} (filterable: {sorted(kinds)})")
        kind = "id" if key == ID else kinds[key]
        at = f"{where}.{key}"
        if not isinstance(value, dict):
            _check_value(value, kind, at)
            continue
        if len(value) != 1:
            raise _refuse(f"{at} takes one operator, got {sorted(value)}")
        [(op, operand)] = value.items()
        if op in MEMBERSHIP:
            if not isinstance(operand, list) or not 1 <= len(operand) <= MAX_IN:
                raise _refuse(f"{at}.{op} needs a list of 1 to {MAX_IN} values")
            for item in operand:
                _check_value(item, kind, f"{at}.{op}")
        elif op in COMPARISONS:
            if op not in ("$eq", "$ne") and kind == "bool":
                raise _refuse(f"{at}.{op} does not order booleans")
            _check_value(operand, kind, f"{at}.{op}")
        else:
            raise _refuse(f"unknown operator {op!r} at {at} (use {sorted([*COMPARISONS, *MEMBERSHIP])})")


def check_filter(value: object, kinds: dict[str, str]) -> str:
    """The filter as canonical JSON (sorted keys: equal filters share a scan), once every column,
    operator and value is known to fit the index (`kinds`: column_kinds of its metadata)."""
    if not kinds:
        raise _refuse("this index was built without metadata columns: nothing to filter on")
    _check(value, kinds, 1, "filter")
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _listed(rows: int, lists: list[np.ndarray]) -> np.ndarray:
    mask = np.zeros(rows, bool)
    for listed in lists:
        mask[listed] = True
    return mask


def _mask(node: dict, table: pa.Table, ids: np.ndarray, postings: Postings | None) -> np.ndarray:
    result = np.ones(len(ids), bool)
    for key, value in node.items():
        if key == "$and":
            part = np.logical_and.reduce([_mask(sub, table, ids, postings) for sub in value])
        elif key == "$or":
            part = np.logical_or.reduce([_mask(sub, table, ids, postings) for sub in value])
        else:
            op, operand = next(iter(value.items())) if isinstance(value, dict) else ("$eq", value)
            operands = operand if op in MEMBERSHIP else [operand]
            if postings is not None and key in postings.columns and op in ("$eq", "$ne", *MEMBERSHIP):
                # the build's posting lists: a lookup per value, no pass over the column
                part = _listed(len(ids), [postings.rows(key, v) for v in operands])
                if op in ("$ne", "$nin"):  # a missing value matches no comparison, as in the scan
                    part = ~part & ~_listed(len(ids), [postings.rows(key, None)])
                result &= part
                continue
            if key == ID:  # int64 as stored (user ids go past float64's exact integers)
                column, values = pa.array(ids, pa.int64()), pa.array(operands, pa.int64())
            elif pa.types.is_integer(table.column(key).type) or pa.types.is_floating(table.column(key).type):
                column, values = pc.cast(table.column(key), pa.float64()), pa.array(operands, pa.float64())
            else:
                column, values = table.column(key), pa.array(operands, table.column(key).type)
            if op in MEMBERSHIP:
                hit = pc.is_in(column, value_set=values)
                if op == "$nin":  # a missing value is in no set and out of none, as with $ne (SQL's NOT IN)
                    hit = pc.and_(pc.invert(hit), pc.is_valid(column))
            else:
                hit = COMPARISONS[op](column, values[0])
            part = np.asarray(pc.fill_null(hit, False))
        result &= part
    return result


@functools.lru_cache(maxsize=256)
def _parsed(filter_json: str) -> dict:
    return orjson.loads(filter_json)


def matching(filter_json: str, table: pa.Table, ids: np.ndarray, postings: Postings | None = None
             ) -> np.ndarray:
    """The ids (of `ids`, the table's rows) that pass a checked filter; equality and membership on a
    column with `postings` (built with the table, same row order) read its lists instead."""
    return ids[_mask(_parsed(filter_json), table, ids, postings)]
