"""The Dataset model every reader returns (float32 base and query matrices, the natural metric, the
user's ids and metadata), and what the readers share: the seeded query rows of base-only sources."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from shardserve.errors import ShardserveError

METRICS = ("l2", "ip", "cosine")
QUERY_SEED = 20260101
# Eval's queries of a base-only source (the user's parquet or .npy files): this many of its own rows,
# picked with QUERY_SEED. They stay in the index (every row a user gives is indexed); each query's
# own row is left out of its ground truth and of its answer (shardserve.data.groundtruth.without_self).
SELF_QUERIES = 1000
BASE_ONLY_METRIC = "l2"  # parquet and .npy carry no metric: the data's natural one (its fingerprint says so)


@dataclass(frozen=True)
class Dataset:
    """Base vectors to index, query vectors to evaluate with, the dataset's natural metric.

    `neighbors` is ground truth shipped with the data (ann-benchmarks, *_groundtruth.ivecs); it is
    only valid for the full, unlimited base set.
    """

    name: str
    base: np.ndarray
    queries: np.ndarray
    metric: str
    neighbors: np.ndarray | None = field(default=None, compare=False)
    ids: np.ndarray | None = field(default=None, compare=False)  # the user's int64 id per base row
    metadata: Any = field(default=None, compare=False)  # pyarrow Table, one row per base row
    # base-only sources: the base row each query is (its self-match is not a neighbour); else None
    query_rows: np.ndarray | None = field(default=None, compare=False)

    @property
    def dim(self) -> int:
        return int(self.base.shape[1])

    def fingerprint(self) -> str:
        """Content hash of base + queries + metric (+ ids): caches keyed on it can never go stale."""
        digest = hashlib.sha256()
        digest.update(f"{self.metric}:{self.base.shape}:{self.queries.shape}".encode())
        digest.update(self.base.data.cast("B"))
        digest.update(self.queries.data.cast("B"))
        if self.ids is not None:
            digest.update(self.ids.data.cast("B"))
        return digest.hexdigest()[:16]

    def index_ids(self) -> np.ndarray:
        """The id stored for each base row: the user's ids, else the row numbers."""
        return self.ids if self.ids is not None else np.arange(len(self.base), dtype=np.int64)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Base row of each id an index returned (-1 for -1 and for ids this dataset lacks)."""
        return rows_of(ids, self.ids, len(self.base))

    def self_ids(self) -> np.ndarray | None:
        """The id each query has in the index (base-only sources), else None."""
        return None if self.query_rows is None else self.index_ids()[self.query_rows]


class VectorRows(NamedTuple):
    """Rows read from a source: the float32 vectors, the user's int64 ids (or None), and their
    metadata columns (a pyarrow Table, or None)."""

    matrix: np.ndarray
    ids: np.ndarray | None
    metadata: Any


def rows_of(ids: np.ndarray, known_ids: np.ndarray | None, base_rows: int) -> np.ndarray:
    """Base row of each id an index returned, given the base's ids (None: ids are row numbers);
    -1 for -1 and for ids the base lacks."""
    ids = np.asarray(ids, dtype=np.int64)
    if known_ids is None:
        return np.where((ids >= 0) & (ids < base_rows), ids, -1)
    order = np.argsort(known_ids, kind="stable")
    position = np.clip(np.searchsorted(known_ids, ids, sorter=order), 0, len(order) - 1)
    rows = order[position]
    return np.where(known_ids[rows] == ids, rows, -1)


def check_ids(name: str, ids: np.ndarray, rows: int) -> None:
    """User ids come back in answers as they are: one per row, int64, >= 0 (FAISS uses -1 for "no
    result"), and unique (a duplicate would make two rows indistinguishable)."""
    if ids.shape != (rows,) or ids.dtype != np.int64:
        raise ShardserveError(f"dataset {name}: ids must be one int64 per row, got {ids.dtype} {ids.shape}")
    if ids.size and ids.min() < 0:
        raise ShardserveError(f"dataset {name}: ids must be >= 0, found {int(ids.min())} "
                              f"(row {int(np.argmin(ids))})")
    unique, counts = np.unique(ids, return_counts=True)
    if unique.size != ids.size:
        repeated = unique[counts > 1]
        raise ShardserveError(f"dataset {name}: {int(ids.size - unique.size)} duplicate ids, e.g. id "
                              f"{int(repeated[0])} on {int(counts[counts > 1][0])} rows")


def as_float32(matrix: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(matrix, dtype=np.float32)


def self_query_rows(rows: int, num_queries: int = SELF_QUERIES) -> np.ndarray:
    """The rows of a base-only source that eval uses as queries (sorted, seeded): up to
    `num_queries` of its `rows`, all of them still indexed."""
    return np.sort(np.random.default_rng(QUERY_SEED).permutation(rows)[:min(num_queries, rows)])


def base_only(name: str, vectors: np.ndarray, **columns) -> Dataset:
    """A user's vectors, every row in the base; the queries are SELF_QUERIES of those rows."""
    own = self_query_rows(len(vectors))
    base = as_float32(vectors)
    return Dataset(name, base, base[own], BASE_ONLY_METRIC, query_rows=own, **columns)
