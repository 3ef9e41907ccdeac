"""The HTTP contract: the request and response models (they document the API at /docs and name the
fields the parser enforces), the error every refusal raises (`ApiError`, defined in shardserve.errors
and shared with the client), and a validated query."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from shardserve.errors import ApiError
from shardserve.tracing import Traced

__all__ = ["KNOWN_PARAMS", "ApiError", "BatchHits", "Coverage", "Limits", "ParsedQuery", "SearchRequest",
           "SearchResponse", "Timing"]

KNOWN_PARAMS = ("nprobe", "efSearch")


class SearchRequest(BaseModel):
    """Exactly one of `vector` (single query) or `vectors` (a batch)."""

    model_config = ConfigDict(extra="forbid")
    vector: list[float] | None = Field(None, description="one query vector of the index's dim")
    vectors: list[list[float]] | None = Field(None, description="a batch of query vectors")
    k: int = Field(10, ge=1, description="neighbours to return (<= max_k)")
    params: dict[str, int] | None = Field(
        None, description="per-request search params: nprobe (IVF lists per shard) or efSearch (HNSW)")
    require_full: bool = Field(False, description="503 instead of a partial answer")
    include: list[str] | None = Field(
        None, description="metadata columns to return with every hit (`metadata`, aligned with `ids`); "
                          "the index's columns are in GET /v1/index")
    filter: dict | None = Field(
        None, description="only rows whose metadata match, in Chroma's `where` syntax: {\"label\": 3}, "
                          "{\"label\": {\"$in\": [1, 3]}}, {\"$and\": [...]}, {\"$or\": [...]}; operators "
                          "$eq $ne $gt $gte $lt $lte $in $nin; \"$id\" filters ids. The answer's "
                          "`matched` counts the rows that match")
    offset: int = Field(0, ge=0, description="hits skipped first (k + offset <= max_k)")
    score_threshold: float | None = Field(
        None, description="hits past it left out: a distance above it (l2), a similarity below it "
                          "(ip, cosine)")


class PointsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: list[int] = Field(description="ids to get (at most max_page); those not held are left out")
    include: list[str] | None = Field(None, description="metadata columns answered (default all)")
    vectors: bool = Field(False, description="answer each point's vector too")


class ScrollRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    after: int | None = Field(None, description="the previous page's `next` (None: from the first id)")
    limit: int = Field(100, ge=1, description="points a page (<= max_page)")
    filter: dict | None = Field(None, description="as a search's")
    include: list[str] | None = Field(None, description="metadata columns answered (default all)")
    vectors: bool = Field(False, description="answer each point's vector too")


class CountRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    filter: dict | None = Field(None, description="as a search's (None: every point)")


class Coverage(BaseModel):
    shards: int
    answered: int


class Timing(BaseModel):
    total: float
    compute: float
    queue: float


class BatchHits(BaseModel):
    """One query's answer inside a batch response (the client's `Hits` holds it as numpy arrays)."""

    ids: list[int]
    distances: list[float]
    metadata: list[dict] | None = None


class SearchResponse(BaseModel):
    ids: list[int] | None = None
    distances: list[float] | None = None
    metadata: list[dict] | None = None
    results: list[BatchHits] | None = None
    coverage: Coverage
    timing_ms: Timing
    index: str
    matched: int | None = Field(None, description="with a filter: the rows that match it, over all shards")


class UpsertRequest(BaseModel):
    """Points to insert or replace (the schema /docs shows; writes.parse checks bodies)."""

    model_config = ConfigDict(extra="forbid")
    ids: list[int] = Field(..., description="int64 >= 0, each once, at most max_write_points")
    vectors: list[list[float]] = Field(..., description="one per id, of the index's dim")
    metadata: list[dict | None] | None = Field(
        None, description="aligned with ids: {column: value} of the columns in GET /v1/index "
                          "(metadata_kinds); null or a missing column is null")


class DeleteRequest(BaseModel):
    """By `ids` or by `filter`, one of the two."""

    model_config = ConfigDict(extra="forbid")
    ids: list[int] | None = Field(None, description="ids to delete (an id the index does not hold is "
                                                    "no error)")
    filter: dict | None = Field(None, description="a search's filter: every point whose latest metadata "
                                                  "passes it when the delete is evaluated (at most "
                                                  "max_filter_delete_points)")


class WriteResponse(BaseModel):
    position: int | None = Field(..., description="the request's place in the write log: durable, and "
                                                  "seen by every search that starts after this answer "
                                                  "(null: a filter matched nothing, nothing was written)")
    upserted: int | None = None
    deleted: int | None = None


@dataclass(frozen=True, kw_only=True)
class ParsedQuery:
    """A validated request: float32 (n, dim) matrix plus what decides how it is searched."""

    matrix: np.ndarray
    k: int
    params: tuple[tuple[str, int], ...]
    single: bool
    require_full: bool
    include: tuple[str, ...] = ()  # metadata columns to return with every hit
    filter: str | None = None  # canonical JSON of a checked filter (query.filters)
    offset: int = 0  # hits skipped: the shards are asked for k (offset included), the first `offset` dropped
    threshold: float | None = None  # hits past this distance (l2) or below this score (ip, cosine) dropped
    trace: Traced | None = field(default=None, compare=False)  # a sampled request's span (shardserve.tracing)

    @property
    def group_key(self) -> tuple:
        """Requests with the same key can share one scan per shard."""
        return (self.k, self.params, self.filter)


@dataclass(frozen=True)
class TextLimits:
    """What one text request may ask for (AppArgs' text fields), shown by GET /v1/index."""

    max_texts: int
    max_text_chars: int
    max_texts_in_flight: int
    embedding_cache_bytes: int


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (AppArgs' max_* fields)."""

    max_k: int
    max_vectors: int
    max_work: int
    max_body_bytes: int
    max_write_points: int = 1000
    max_write_backlog: int = 200_000  # upserts not yet compacted (shardserve.writes.delta.MAX_DELTA_ROWS)
    max_filter_delete_points: int = 10_000  # shardserve.writes.accept.MAX_FILTER_DELETE
    max_write_backlog_bytes: int = 1 << 30  # shardserve.writes.accept.MAX_BACKLOG_BYTES
    max_metadata_bytes: int = 16 * 1024  # a point's (shardserve.writes.parse.MAX_METADATA_BYTES)
    max_string_bytes: int = 8 * 1024  # a string value's (shardserve.writes.parse.MAX_STRING_BYTES)
    max_page: int = 1000  # points a get by ids or a scroll page answers (shardserve.writes.points)
