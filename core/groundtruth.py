"""Exact top-k ground truth, computed once per dataset fingerprint and cached on disk."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import faiss
import numpy as np

from core.datasets import Dataset
from core.errors import ShardserveError
from core.indexes import FAISS_METRIC, prepare_vectors

GROUND_TRUTH_K = 100
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    root = os.environ.get("SHARDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "shardserve")
    return Path(root) / "groundtruth"


def exact_search(base: np.ndarray, queries: np.ndarray, k: int, metric: str,
                 batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force top-k with a FAISS flat index (BLAS), in query batches to bound memory."""
    index = faiss.IndexFlat(base.shape[1], FAISS_METRIC[metric])
    index.add(prepare_vectors(base, metric))
    prepared = prepare_vectors(queries, metric)
    k = min(k, len(base))
    distances = np.empty((len(queries), k), dtype=np.float32)
    ids = np.empty((len(queries), k), dtype=np.int64)
    for start in range(0, len(queries), batch_size):
        stop = start + batch_size
        distances[start:stop], ids[start:stop] = index.search(prepared[start:stop], k)
    return distances, ids


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
    path = cache_dir() / f"{_safe(dataset.name)}-{dataset.fingerprint()}-k{k}.npy"
    if path.exists():
        cached = np.load(path, allow_pickle=False)
        if cached.shape == (len(dataset.queries), min(k, len(dataset.base))):
            return cached
    log.info("computing exact top-%d for %d queries of %s", k, len(dataset.queries), dataset.name)
    _, ids = exact_search(dataset.base, dataset.queries, k, dataset.metric)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, ids)
        tmp.replace(path)
    except OSError as exc:  # a read-only cache costs time, not correctness
        log.warning("cannot cache ground truth at %s: %s", path, exc)
    return ids


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
    hits = 0
    for start in range(0, len(queries), 512):
        rows = slice(start, start + 512)
        dist = _exact_distance(queries[rows], base[safe_ids[rows]], dataset.metric)
        if dataset.metric == "l2":
            ok = dist <= true_kth[rows, None] * (1 + 1e-5) + 1e-6
        else:
            ok = dist >= true_kth[rows, None] - 1e-5 * np.abs(true_kth[rows, None]) - 1e-6
        hits += int((ok & valid[rows]).sum())
    return hits / (len(queries) * k)


def _exact_distance(queries: np.ndarray, candidates: np.ndarray, metric: str) -> np.ndarray:
    """queries (n, d) against candidates (n, m, d) → (n, m) squared L2 or inner product."""
    if metric == "l2":
        diff = candidates - queries[:, None, :]
        return np.einsum("nmd,nmd->nm", diff, diff)
    return np.einsum("nmd,nd->nm", candidates, queries)
