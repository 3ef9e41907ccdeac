"""Answers: a search result as the API's JSON, coverage errors, the index summary."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np
import orjson

from shardserve.index.manifest import Manifest
from shardserve.query.api import ApiError, Limits, ParsedQuery, TextLimits
from shardserve.query.merge import QueryResult


def hits(ids: np.ndarray, distances: np.ndarray) -> dict:
    """One query's answer: real hits only. FAISS pads with id -1 (and +-3.4e38 distances) when
    fewer than k candidates were found (small nprobe, few vectors): those never leave the server."""
    real = ids >= 0
    if not real.all():
        ids, distances = ids[real], distances[real]
    return {"ids": ids, "distances": distances}  # numpy: orjson writes float32 at its own precision


def windowed(query: ParsedQuery, result: QueryResult, ip: bool) -> QueryResult:
    """The hits a request asked for: its first `offset` dropped (the shards were asked for them
    too), and those past its `score_threshold` (a larger distance under l2, a smaller score under
    ip and cosine) padded out as FAISS pads (id -1), so that `hits` leaves them out."""
    if not query.offset and query.threshold is None:
        return result
    ids, distances = result.ids[:, query.offset:], result.distances[:, query.offset:]
    if query.threshold is not None:
        past = distances < query.threshold if ip else distances > query.threshold
        ids = np.where(past, -1, ids)
    return dataclasses.replace(result, ids=ids, distances=distances)


def coverage_error(query: ParsedQuery, result: QueryResult, retry_after_s: float) -> ApiError | None:
    """503 when no shard answered, or fewer than all and the client asked for `require_full`;
    otherwise the (possibly partial) answer stands and its coverage says how many shards it has."""
    if result.answered == 0:
        return ApiError(503, None, "no shard answered in time", retry_after_s)
    if query.require_full and result.answered < result.shards:
        return ApiError(503, "require_full", f"only {result.answered} of {result.shards} shards answered "
                                             "in time", retry_after_s)
    return None


def _matched(query: ParsedQuery, result: QueryResult) -> dict:
    return {} if query.filter is None else {"matched": result.matched}


def render_search(query: ParsedQuery, result: QueryResult, total_ms: float, index_version: str,
                  metadata: list[list[dict]] | None = None, embedded: dict | None = None) -> bytes:
    """The /v1/search response body (SearchResponse's fields), numpy arrays written by orjson.
    `metadata`: per query, per real hit (`real_ids`), the `include` columns; `embedded`: a text
    request's `embedding` (the model, the texts truncated, the cache's hits) and its time."""
    answers = [hits(i, d) for i, d in zip(result.ids, result.distances, strict=True)]
    for answer, rows in zip(answers, metadata or [], strict=False):
        answer["metadata"] = rows
    payload: dict = {}
    if query.single:
        payload.update(answers[0])
    else:
        payload["results"] = answers
    payload["coverage"] = {"shards": result.shards, "answered": result.answered}
    payload["timing_ms"] = {"total": round(total_ms, 3), "compute": round(result.compute_ms, 3),
                            "queue": round(max(total_ms - result.compute_ms, 0.0), 3)}
    if embedded is not None:
        payload["timing_ms"]["embed"] = round(embedded.pop("ms"), 3)
        payload["embedding"] = embedded
    payload["index"] = index_version
    payload["batch"] = result.batch_size
    payload.update(_matched(query, result))
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def index_summary(manifest: Manifest, supported: Collection[str], limits: Limits,
                  text: TextLimits | None = None) -> dict:
    """GET /v1/index: the manifest being served and the request limits (`text`: those of text
    requests, shown for an index built from text)."""
    return {
        "index_version": manifest.index_version, "index_factory": manifest.index_factory,
        "dim": manifest.dim, "metric": manifest.metric, "num_vectors": manifest.num_vectors,
        "dataset": manifest.dataset.model_dump(), "created_at": manifest.created_at,
        "shards": [{"name": s.name, "num_vectors": s.num_vectors, "bytes": s.bytes} for s in manifest.shards],
        "params": sorted(supported), "max_k": limits.max_k, "max_vectors": limits.max_vectors,
        "max_body_bytes": limits.max_body_bytes, "max_work": limits.max_work,
        "max_write_points": limits.max_write_points, "max_write_backlog": limits.max_write_backlog,
        "max_filter_delete_points": limits.max_filter_delete_points,
        "max_write_backlog_bytes": limits.max_write_backlog_bytes,
        "max_metadata_bytes": limits.max_metadata_bytes, "max_string_bytes": limits.max_string_bytes,
        "max_page": limits.max_page,
        "log_position": manifest.log_position,
        "metadata_kinds": manifest.dataset.metadata_kinds,
        "embedder": None if manifest.embedder is None else manifest.embedder.model_dump(),
        **({"text": {**dataclasses.asdict(text), "max_tokens": manifest.embedder.max_tokens,
                     "past_max_tokens": "truncated (the answer's embedding.truncated lists the texts)"}}
           if text is not None and manifest.embedder is not None else {}),
    }


def real_ids(result: QueryResult) -> list[np.ndarray]:
    """Per query, the ids a response carries (FAISS's -1 padding dropped, as `hits` does)."""
    return [ids[ids >= 0] for ids in result.ids]
