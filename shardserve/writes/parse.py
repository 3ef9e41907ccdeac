"""The router's parser for write bodies: `POST /v1/upsert` and `POST /v1/delete` into validated
operations (shardserve.writes.ops), or a 422 naming the field at fault.

Why refuse so much up front: a write is acknowledged only once it is in the log, and every replica
of every shard applies the log as it is, forever (until compaction). Whatever would fail later
(a wrong dimension in FAISS, a metadata value a filter cannot compare, an id FAISS reads as "no
result") must fail here, for the whole request: nothing is half-applied.

Vectors go through the search parser's own checks (dimension, NaN/Inf, absurd magnitudes, zero rows
under cosine) and are stored as the index stores them (normalised for cosine). Metadata values
must fit their column's kind (shardserve.index.metadata.column_kinds): integers exact and inside
their column's type, as filters compare them.

    {"ids": [int64 >= 0, ...], "vectors": [[float x dim], ...], "metadata": [{"col": value} | null, ...]}
    {"ids": [int64 >= 0, ...]}  or  {"filter": {...}}   (a delete: by id or by a search's filter)

Or, for bulk loads, `Content-Type: application/x-npy`: the ids as one .npy array (integers, (n,))
followed in the same body by the vectors as another ((n, dim) floats), or the ids alone for a
delete; no metadata (send JSON for that). Why: 100 points of 784 dims are 78,400 JSON numbers to
parse, against two header checks and a view of the bytes here; parsed by the search's own .npy
reader (shardserve.query.parse: headers bounded, never unpickled, the data's length checked).
"""

from __future__ import annotations

import math

import numpy as np
import orjson

from shardserve.index.indexes import prepare_vectors
from shardserve.index.metadata import EXACT_FLOAT, FLOAT_KINDS, FLOAT_MAX, INTEGER_KINDS
from shardserve.query.api import ApiError
from shardserve.query.filters import check_filter
from shardserve.query.parse import _checked, _matrix, _npy_header, _npy_matrix
from shardserve.writes.ops import MAX_ID, Delete, Upsert

UPSERT_FIELDS = ("ids", "vectors", "metadata")
# A point's metadata, as the log stores it (JSON), and one string value in it: every replica of
# every shard holds each upserted point's metadata until compaction, and the backlog's byte bound
# (writes.accept) counts it, so no single point may take a share of that out of proportion
# (GET /v1/index: max_metadata_bytes, max_string_bytes).
MAX_METADATA_BYTES = 16 * 1024
MAX_STRING_BYTES = 8 * 1024


def _payload(body: bytes, fields: tuple[str, ...]) -> dict:
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if b"vectors" in body and (b"NaN" in body or b"Infinity" in body or "infinity" in str(exc)):
            raise ApiError(422, "vectors", "vectors contain NaN/Infinity (not valid JSON numbers)") from None
        raise ApiError(422, "body", f"body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ApiError(422, "body", "body must be a JSON object")
    unknown = sorted(set(payload) - set(fields))
    if unknown:
        raise ApiError(422, unknown[0], f"unknown field(s) {unknown}: use {list(fields)}")
    return payload


def _ids(value: object, max_points: int) -> list[int]:
    """Distinct JSON integers in [0, 2^63 - 1], at least one, at most `max_points`."""
    if not isinstance(value, list) or not value:
        raise ApiError(422, "ids", "ids must be a non-empty list of integers")
    if len(value) > max_points:
        raise ApiError(422, "ids", f"too many points: {len(value)} > max {max_points} per request")
    seen: set[int] = set()
    for slot, id_ in enumerate(value):
        if not isinstance(id_, int) or isinstance(id_, bool):
            raise ApiError(422, "ids", f"ids[{slot}] must be a JSON integer (an int64 >= 0), got "
                                       f"{type(id_).__name__} {str(id_)[:40]!r}")
        if not 0 <= id_ <= MAX_ID:
            raise ApiError(422, "ids", f"ids[{slot}] = {id_} is outside [0, {MAX_ID}] (int64 >= 0)")
        if id_ in seen:
            raise ApiError(422, "ids", f"ids[{slot}] = {id_} appears twice in one request: send one "
                                       "operation per id")
        seen.add(id_)
    return value


def _value(value: object, kind: str, where: str) -> object:
    """A metadata value checked against its column's kind (null: missing, always allowed)."""
    if value is None:
        return None
    if kind in INTEGER_KINDS:
        if isinstance(value, float) and value.is_integer() and abs(value) <= EXACT_FLOAT:
            value = int(value)  # 3.0 is 3; past 2^53 a float may not be the integer that was meant
        if not isinstance(value, int) or isinstance(value, bool):
            raise ApiError(422, "metadata", f"{where} needs an integer ({kind} column; past 2^53 a JSON "
                                            f"integer, not a float), got {type(value).__name__} "
                                            f"{str(value)[:40]!r}")
        low, high = INTEGER_KINDS[kind]
        if not low <= value <= high:
            raise ApiError(422, "metadata", f"{where} = {value} is outside the {kind} column's range "
                                            f"[{low}, {high}]")
        return value
    if kind in FLOAT_KINDS and isinstance(value, (int, float)) and not isinstance(value, bool):
        if kind in FLOAT_MAX and math.isfinite(value) and abs(value) > FLOAT_MAX[kind]:
            raise ApiError(422, "metadata", f"{where} = {value:g} is outside the {kind} column's range "
                                            f"(|x| <= {FLOAT_MAX[kind]:.7g})")
        if math.isfinite(value) and abs(value) < 1e308:
            return float(value)
    elif kind == "string" and isinstance(value, str):
        # a character is 1 to 4 bytes of UTF-8: only a long string is encoded to be measured
        if len(value) > MAX_STRING_BYTES // 4 and len(value.encode("utf-8", "surrogatepass")) > \
                MAX_STRING_BYTES:
            raise ApiError(422, "metadata", f"{where} is a string of more than {MAX_STRING_BYTES} bytes "
                                            "(max_string_bytes)")
        return value
    elif kind == "bool" and isinstance(value, bool):
        return value
    raise ApiError(422, "metadata", f"{where} needs a {kind}, got {type(value).__name__} {str(value)[:40]!r}")


def _metadata(value: object, count: int, kinds: dict[str, str]) -> list[dict | None]:
    if value is None:
        return [None] * count
    if not isinstance(value, list) or len(value) != count:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise ApiError(422, "metadata", f"metadata must be a list aligned with ids: {count} entries "
                                        f"(an object or null each), got {got}")
    rows: list[dict | None] = []
    for slot, row in enumerate(value):
        if row is None:
            rows.append(None)
            continue
        if not isinstance(row, dict):
            raise ApiError(422, "metadata", f"metadata[{slot}] must be an object or null")
        unknown = sorted(set(row) - set(kinds))
        if unknown:
            raise ApiError(422, "metadata", f"metadata[{slot}]: unknown column {unknown[0]!r} (this "
                                            f"index has: {sorted(kinds) or 'none'})")
        checked = {name: _value(item, kinds[name], f"metadata[{slot}].{name}") for name, item in row.items()}
        size = len(orjson.dumps(checked))  # what the log stores
        if size > MAX_METADATA_BYTES:
            raise ApiError(422, "metadata", f"metadata[{slot}] is {size} bytes of JSON, more than "
                                            f"{MAX_METADATA_BYTES} a point (max_metadata_bytes)")
        rows.append(checked)
    return rows


def parse_upsert(body: bytes, dim: int, metric: str, kinds: dict[str, str], max_points: int) -> list[Upsert]:
    """A /v1/upsert body checked against the served index (`kinds`: column_kinds of its metadata)."""
    payload = _payload(body, UPSERT_FIELDS)
    ids = _ids(payload.get("ids"), max_points)
    if "vectors" not in payload:
        raise ApiError(422, "vectors", "vectors is required: one per id")
    vectors = payload["vectors"]
    if isinstance(vectors, list) and len(vectors) != len(ids):
        raise ApiError(422, "vectors", f"vectors must be aligned with ids: {len(ids)} ids, {len(vectors)} "
                                       "vectors")
    matrix = _matrix(vectors, "vectors", False, dim, max_points, metric, b"true" in body or b"false" in body)
    matrix = prepare_vectors(matrix, metric)  # stored as the index stores it
    metadata = _metadata(payload.get("metadata"), len(ids), kinds)
    return [Upsert(id_, matrix[slot], metadata[slot]) for slot, id_ in enumerate(ids)]


def parse_delete(body: bytes, max_points: int) -> list[Delete]:
    """A /v1/delete body by ids: the ids to delete (an id not in the index is no error: nothing to do)."""
    return [Delete(id_) for id_ in _ids(_payload(body, ("ids",)).get("ids"), max_points)]


def delete_filter(body: bytes, kinds: dict[str, str], rows: int) -> str | None:
    """A /v1/delete body by filter: the filter, checked and canonical as a search's (query.filters);
    None for a body by ids (parse_delete reads it). One of the two, never both."""
    payload = _payload(body, ("ids", "filter"))
    if "filter" not in payload:
        return None
    if "ids" in payload:
        raise ApiError(422, "filter", "a delete takes `ids` or a `filter`, not both")
    return check_filter(payload["filter"], kinds, rows)



def _npy_ids(body: bytes, max_points: int) -> tuple[list[int], int]:
    """(the ids, where the body's next array starts) from the .npy array of ids that opens a body:
    integers of any width in [0, 2^63 - 1], distinct, at least one, at most `max_points`."""
    shape, _, dtype, start = _npy_header(body)
    if dtype.kind not in "iu" or dtype.hasobject:
        raise ApiError(422, "ids", f"the ids array must hold integers, not {dtype}")
    if len(shape) != 1 or not shape[0]:
        raise ApiError(422, "ids", f"the ids array must be (n,) and non-empty, got {shape}")
    if shape[0] > max_points:
        raise ApiError(422, "ids", f"too many points: {shape[0]} > max {max_points} per request")
    end = start + shape[0] * dtype.itemsize
    if end > len(body):
        raise ApiError(422, "body", "the ids array's data is cut short")
    ids = np.frombuffer(body, dtype, shape[0], start)
    bad = ids > MAX_ID if dtype.kind == "u" else ids < 0
    if bad.any():
        slot = int(np.flatnonzero(bad)[0])
        raise ApiError(422, "ids", f"ids[{slot}] = {ids[slot]} is outside [0, {MAX_ID}] (int64 >= 0)")
    order = np.argsort(ids, kind="stable")
    twice = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if len(twice):
        slot = int(order[twice[0] + 1])
        raise ApiError(422, "ids", f"ids[{slot}] = {ids[slot]} appears twice in one request: send one "
                                   "operation per id")
    return [int(i) for i in ids.tolist()], end


def parse_upsert_npy(body: bytes, dim: int, metric: str, max_points: int) -> list[Upsert]:
    """A /v1/upsert .npy body: the ids array, then the vectors array ((n, dim), or (dim,) for one)."""
    ids, at = _npy_ids(body, max_points)
    if at == len(body):
        raise ApiError(422, "vectors", "vectors is required: a second .npy array after the ids")
    matrix, _ = _npy_matrix(body, dim, max_points, at)
    if len(matrix) != len(ids):
        raise ApiError(422, "vectors", f"vectors must be aligned with ids: {len(ids)} ids, {len(matrix)} "
                                       "vectors")
    matrix = prepare_vectors(_checked(matrix, "vectors", dim, metric), metric)
    return [Upsert(id_, matrix[slot], None) for slot, id_ in enumerate(ids)]


def parse_delete_npy(body: bytes, max_points: int) -> list[Delete]:
    """A /v1/delete .npy body: the ids array alone."""
    ids, at = _npy_ids(body, max_points)
    if at != len(body):
        raise ApiError(422, "body", f"a delete's .npy body holds the ids alone: {len(body) - at} bytes "
                                    "follow them")
    return [Delete(id_) for id_ in ids]
