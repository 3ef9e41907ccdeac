"""Exact top-k ground truth, computed once per dataset fingerprint and cached on disk."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import faiss
import numpy as np

from shardserve.data.datasets import Dataset
from shardserve.errors import ShardserveError
from shardserve.index.indexes import FAISS_METRIC, prepare_vectors
from shardserve.index.storage import cache_root
from shardserve.query.merge import merge_topk

GROUND_TRUTH_K = 100
PROGRESS_AFTER_S = 10.0  # long work shows a progress bar once it has run this long


def progress(items, what: str, **options):
    """`items`, with a tqdm progress bar on stderr that appears only if the loop runs past
    PROGRESS_AFTER_S (short runs stay quiet)."""
    from tqdm import tqdm

    return tqdm(items, desc=what, delay=PROGRESS_AFTER_S, leave=False, **options)
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Exact ground truth, keyed by the dataset's fingerprint, in the node's cache (index.storage)."""
    return Path(cache_root()) / "groundtruth"


TRUTH_CHUNK_ROWS = 65536  # base rows per brute-force scan: bounded memory, whatever the base's size


class ExactTopK:
    """Exact top-k of fixed queries over a base that arrives in chunks (FAISS brute force per chunk,
    `merge_topk` across chunks), so no copy of the whole base is ever made: the base may be a file
    streamed from disk (serving.evaluate) or a matrix already in memory (`exact_search`)."""

    def __init__(self, queries: np.ndarray, k: int, metric: str, exclude: np.ndarray | None = None):
        """`exclude`: per query, a base row that is not its neighbour (the query's own row, when the
        queries are rows of the base); None: none."""
        self.queries, self.k, self.metric = prepare_vectors(queries, metric), k, metric
        self.exclude = exclude
        self.higher_is_better = metric != "l2"
        worst = -np.inf if self.higher_is_better else np.inf
        self.distances = np.full((len(queries), k), worst, np.float32)
        self.rows = np.full((len(queries), k), -1, np.int64)

    def add(self, first_row: int, chunk: np.ndarray) -> None:
        """Base rows first_row .. first_row + len(chunk) - 1 (already float32, not yet prepared)."""
        index = faiss.IndexFlat(chunk.shape[1], FAISS_METRIC[self.metric])
        index.add(prepare_vectors(chunk, self.metric))
        extra = 0 if self.exclude is None else 1  # the excluded row may be among the top k
        found_distances, found = index.search(self.queries, min(self.k + extra, len(chunk)))
        found = np.where(found >= 0, found + first_row, -1)
        if self.exclude is not None:
            own = found == self.exclude[:, None]
            found[own] = -1
            found_distances[own] = -np.inf if self.higher_is_better else np.inf
        self.distances, self.rows = merge_topk([self.distances, found_distances], [self.rows, found],
                                               self.k, self.higher_is_better)


def exact_search(base: np.ndarray, queries: np.ndarray, k: int, metric: str,
                 chunk_rows: int = TRUTH_CHUNK_ROWS, exclude: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force top-k of an in-memory base, scanned TRUTH_CHUNK_ROWS rows at a time (`exclude`:
    as ExactTopK's)."""
    k = min(k, len(base) - (exclude is not None))
    exact = ExactTopK(queries, k, metric, exclude)
    for first in progress(range(0, len(base), chunk_rows), "exact ground truth", unit="chunk"):
        exact.add(first, base[first:first + chunk_rows])
    return exact.distances, exact.rows


def graded_as(dataset: Dataset, metric: str) -> Dataset:
    """The dataset as an index built with `metric` sees it: ground truth and recall under the index's
    metric. Parquet and .npy files carry none (their natural one is l2) and users build them as
    cosine or ip; neighbours shipped with the data belong to the data's own metric, so they are
    dropped when the two differ. The fingerprint covers the metric: separate cache entries."""
    if metric == dataset.metric:
        return dataset
    return dataclasses.replace(dataset, metric=metric, neighbors=None)


def ground_truth(dataset: Dataset, k: int = GROUND_TRUTH_K) -> np.ndarray:
    """Ids of the exact top-`k` of every query; cached under the dataset's content fingerprint."""
    if dataset.neighbors is not None:  # shipped with the data (ann-benchmarks, *_groundtruth.ivecs)
        return dataset.neighbors
    own = dataset.query_rows
    kind = "" if own is None else "-self"  # queries are base rows, their own left out
    path = cache_dir() / f"{_safe(dataset.name)}-{dataset.fingerprint()}{kind}-k{k}.npy"
    cached = load_cached(path, (len(dataset.queries), min(k, len(dataset.base) - (own is not None))))
    if cached is not None:
        return cached
    log.info("computing exact top-%d for %d queries of %s", k, len(dataset.queries), dataset.name)
    _, ids = exact_search(dataset.base, dataset.queries, k, dataset.metric, exclude=own)
    save_cached(path, ids)
    return ids


def streamed_truth_path(name: str, fingerprint: str, metric: str, depth: int) -> Path:
    """Where the streamed eval keeps the exact top-`depth` distances of a file dataset's queries
    (its own rows, each left out of its own truth): `fingerprint` is the files' (scan's), graded
    under `metric` (the index's)."""
    return cache_dir() / f"{_safe(name)}-{fingerprint}-self-{metric}-k{depth}-distances.npy"


def without_self(found: np.ndarray, self_ids: np.ndarray | None, k: int) -> np.ndarray:
    """The first `k` ids of each answer other than the query's own id (`self_ids`, one per query;
    None: the answers as they are). Search k + 1 to keep k: the own row is usually the first hit."""
    if self_ids is None:
        return found[:, :k]
    order = np.argsort(found == self_ids[:, None], axis=1, kind="stable")  # own id last, others kept in order
    return np.take_along_axis(found, order, axis=1)[:, :k]


def load_cached(path: Path, shape: tuple[int, ...]) -> np.ndarray | None:
    """A cached array of the expected shape, else None (missing, another shape, unreadable)."""
    try:
        cached = np.load(path, allow_pickle=False) if path.exists() else None
    except (OSError, ValueError):
        return None
    return cached if cached is not None and cached.shape == shape else None


def save_cached(path: Path, array: np.ndarray) -> None:
    """Atomically (write, then rename): a reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, array)
        tmp.replace(path)
    except OSError as exc:  # a read-only cache costs time, not correctness
        log.warning("cannot cache ground truth at %s: %s", path, exc)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60]


def recall_at_k(found_ids: np.ndarray, dataset: Dataset, k: int, truth: np.ndarray) -> float:
    """k-NN recall with ties: a found id counts when its exact distance is within the k-th true one.

    Exact distances are recomputed for the returned ids, so approximate (PQ) distances and
    equidistant duplicates (common in Fashion-MNIST) are judged fairly, as ann-benchmarks does.
    """
    if k > truth.shape[1]:
        raise ShardserveError(f"k={k} exceeds the ground truth depth {truth.shape[1]}")
    found_rows = dataset.rows_of(found_ids[:, :k])  # the user's ids (or row numbers) → base rows
    base = prepare_vectors(dataset.base, dataset.metric)
    queries = prepare_vectors(dataset.queries, dataset.metric)
    valid = found_rows >= 0
    safe_ids = np.where(valid, found_rows, 0)
    true_kth = _exact_distance(queries, base[truth[:, k - 1]][:, None, :], dataset.metric)[:, 0]
    found = np.concatenate([_exact_distance(queries[rows], base[safe_ids[rows]], dataset.metric)
                            for rows in (slice(s, s + 512) for s in range(0, len(queries), 512))])
    return recall_from_distances(found, valid, true_kth, dataset.metric)


def recall_from_distances(found: np.ndarray, valid: np.ndarray, true_kth: np.ndarray, metric: str) -> float:
    """The share of found (query, rank) pairs that are real hits at least as near as the k-th true
    neighbour (relative tolerance 1e-5: float rounding is not a miss)."""
    if metric == "l2":
        ok = found <= true_kth[:, None] * (1 + 1e-5) + 1e-6
    else:
        ok = found >= true_kth[:, None] - 1e-5 * np.abs(true_kth[:, None]) - 1e-6
    return int((ok & valid).sum()) / valid.size


class FoundDistances:
    """Exact distances of the rows a search returned, filled chunk by chunk as the base streams by
    (the streamed eval's half of `recall_at_k`)."""

    def __init__(self, queries: np.ndarray, found_rows: np.ndarray, metric: str):
        self.queries, self.rows, self.metric = prepare_vectors(queries, metric), found_rows, metric
        self.distances = np.zeros(found_rows.shape, np.float32)

    def add(self, first_row: int, chunk: np.ndarray) -> None:
        query, rank = np.nonzero((self.rows >= first_row) & (self.rows < first_row + len(chunk)))
        if query.size:
            picked = np.ascontiguousarray(chunk[self.rows[query, rank] - first_row])
            vectors = prepare_vectors(picked, self.metric)[:, None, :]
            self.distances[query, rank] = _exact_distance(self.queries[query], vectors, self.metric)[:, 0]


def _exact_distance(queries: np.ndarray, candidates: np.ndarray, metric: str) -> np.ndarray:
    """queries (n, d) against candidates (n, m, d) → (n, m) squared L2 or inner product."""
    if metric == "l2":
        diff = candidates - queries[:, None, :]
        return np.einsum("nmd,nmd->nm", diff, diff)
    return np.einsum("nmd,nd->nm", candidates, queries)
