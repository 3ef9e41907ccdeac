"""The point API's requests and answers, plain Python: get by ids (`POST /v1/points`), count
(`POST /v1/count`) and scroll (`POST /v1/scroll`), each checked against the served index before
any shard sees it, and the shards' answers combined.

Every shard is asked (an id lives where its writes routed it, or where the build placed it), and
each answers once it has applied every write committed before the call: a 200 to a write is
visible to a get, a count or a scroll after it, as to a search.

An id that an overwrite moved between shards may be answered by two shards that applied the log
to different positions: a get keeps the copy of the shard that had applied more, a scroll counts
it once; a count, which moves no ids, sums the shards' counts (an id moving during the count may
be counted twice or not at all).

Scroll pages are in ascending id order: `after` is the last id of the page before (the answer's
`next`), so a page is stable whatever is written meanwhile (an id written behind the cursor is
seen by a later scroll, not this one). A page costs each shard a pass over its ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from shardserve.index.manifest import Manifest
from shardserve.query.api import ApiError
from shardserve.query.filters import check_filter
from shardserve.writes.ops import MAX_ID

MAX_PAGE = 1000  # points one get or one scroll page answers at most (GET /v1/index: max_page)


@dataclass(frozen=True)
class PointsQuery:
    """A get by ids: the ids (distinct, in the order asked), the metadata columns answered, and
    whether the vectors are."""

    ids: tuple[int, ...]
    include: tuple[str, ...]
    vectors: bool


@dataclass(frozen=True)
class ScrollQuery:
    """A scroll page: the ids past `after` (None: from the first), at most `limit`, passing `filter`
    (a checked filter, None: all), with their `include` columns and, if asked, their vectors."""

    after: int | None
    limit: int
    filter: str | None
    include: tuple[str, ...]
    vectors: bool


def _object(body: bytes, fields: set[str]) -> dict:
    try:
        payload = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError as exc:
        raise ApiError(422, "body", f"body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ApiError(422, "body", "body must be a JSON object")
    unknown = sorted(set(payload) - fields)
    if unknown:
        raise ApiError(422, unknown[0], f"unknown field(s) {unknown}")
    return payload


def _id(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_ID:
        raise ApiError(422, field, f"an id is an integer in [0, 2^63 - 1], got {value!r}")
    return value


def _include(value: object, manifest: Manifest) -> tuple[str, ...]:
    """The columns answered: every metadata column by default, or those named (none: [])."""
    columns = manifest.dataset.metadata_columns
    if value is None:
        return tuple(columns)
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise ApiError(422, "include", "include must be a list of metadata column names")
    missing = [c for c in value if c not in columns]
    if missing:
        raise ApiError(422, "include", f"no metadata column {missing[0]!r} in this index (it has: "
                                       f"{columns or 'none'})")
    return tuple(dict.fromkeys(value))


def _flag(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise ApiError(422, field, f"{field} must be true or false")
    return value


def _where(value: object, manifest: Manifest) -> str | None:
    if value is None:
        return None
    return check_filter(value, manifest.dataset.metadata_kinds,
                        max((shard.num_vectors for shard in manifest.shards), default=0))


def parse_points(body: bytes, manifest: Manifest, max_page: int = MAX_PAGE) -> PointsQuery:
    """`{"ids": [...], "include": [...], "vectors": false}` checked: at most `max_page` ids."""
    payload = _object(body, {"ids", "include", "vectors"})
    ids = payload.get("ids")
    if not isinstance(ids, list) or not ids:
        raise ApiError(422, "ids", "ids must be a non-empty list of integer ids")
    if len(ids) > max_page:
        raise ApiError(422, "ids", f"at most {max_page} ids a request (max_page), got {len(ids)}")
    checked = tuple(dict.fromkeys(_id(value, "ids") for value in ids))
    return PointsQuery(checked, _include(payload.get("include"), manifest),
                       _flag(payload.get("vectors", False), "vectors"))


def parse_scroll(body: bytes, manifest: Manifest, max_page: int = MAX_PAGE) -> ScrollQuery:
    """`{"after": ID, "limit": N, "filter": {...}, "include": [...], "vectors": false}` checked."""
    payload = _object(body, {"after", "limit", "filter", "include", "vectors"})
    after = payload.get("after")
    limit = payload.get("limit", 100)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= max_page:
        raise ApiError(422, "limit", f"limit must be an integer in [1, {max_page}], got {limit!r}")
    return ScrollQuery(None if after is None else _id(after, "after"), limit,
                       _where(payload.get("filter"), manifest), _include(payload.get("include"), manifest),
                       _flag(payload.get("vectors", False), "vectors"))


def parse_count(body: bytes, manifest: Manifest) -> str | None:
    """`{"filter": {...}}` (or an empty body: every point) checked: the filter, or None."""
    return _where(_object(body, {"filter"}).get("filter"), manifest)


def page(per_shard: Sequence[np.ndarray], limit: int) -> tuple[np.ndarray, bool]:
    """The shards' pages (each its first `limit` + 1 ids past the cursor, ascending) as one: the
    first `limit` distinct ids, and whether any follow them (one more is what tells)."""
    merged = np.unique(np.concatenate([np.asarray(ids, np.int64) for ids in per_shard]))
    return merged[:limit], len(merged) > limit


def picked(per_shard: Sequence[tuple[list[dict | None], np.ndarray | None, int]],
           count: int) -> tuple[list[dict | None], list[np.ndarray | None]]:
    """The shards' answers to a get of `count` ids → per id, its columns and vector (None, None: no
    shard holds it), from the shard that had applied the most writes among those holding it."""
    found: list[dict | None] = [None] * count
    vectors: list[np.ndarray | None] = [None] * count
    newest = [-1] * count
    for rows, matrix, position in per_shard:
        for slot, row in enumerate(rows):
            if row is not None and position > newest[slot]:
                found[slot], newest[slot] = row, position
                vectors[slot] = None if matrix is None else matrix[slot]
    return found, vectors


def rendered(ids: Sequence[int], found: Sequence[dict | None], vectors: Sequence[np.ndarray | None],
             with_vectors: bool) -> list[dict]:
    """The points held, in the order of `ids`: {"id", "metadata", and "vector" when asked}."""
    points = []
    for id_, row, vector in zip(ids, found, vectors, strict=True):
        if row is not None:
            point: dict = {"id": int(id_), "metadata": row}
            if with_vectors:
                point["vector"] = vector
            points.append(point)
    return points
