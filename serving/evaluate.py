"""`shardserve eval`: recall@k and QPS of a sharded index, in-process or over the HTTP API.

In-process eval runs every shard's search and the router's `merge_topk`, so a recall measured here is
the recall the service returns; `--url` measures the service itself.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from index_build.publish import BuildParams, training_sample
from shardserve.data.datasets import Dataset, is_npy_dir_spec, is_parquet_spec, load_dataset, rows_of
from shardserve.data.groundtruth import (
    GROUND_TRUTH_K,
    ExactTopK,
    FoundDistances,
    exact_search,
    graded_as,
    ground_truth,
    load_cached,
    progress,
    recall_at_k,
    recall_from_distances,
    save_cached,
    streamed_truth_path,
    without_self,
)
from shardserve.errors import ShardserveError
from shardserve.index.assigner import CoarseAssigner, load_assigner
from shardserve.index.indexes import add_to_copy, prepare_vectors, train_empty_index
from shardserve.index.manifest import Manifest, read_manifest
from shardserve.index.storage import Location
from shardserve.query.merge import merge_topk
from shardserve.query.searcher import ShardSearcher, load_all_shards
from shardserve.transport.shard_wire import ShardQuery


@dataclass
class EvalResult:
    recall: float
    k: int
    queries: int
    qps: float
    mode: str
    params: dict
    shards: int
    index_version: str


def search_params_from_flags(nprobe: int | None, ef_search: int | None) -> dict:
    params: dict = {}
    if nprobe is not None:
        params["nprobe"] = nprobe
    if ef_search is not None:
        params["efSearch"] = ef_search
    return params


def sharded_search(searchers: list[ShardSearcher], queries: np.ndarray, k: int, params: dict,
                   metric: str, assigner: CoarseAssigner | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What the router does, in-process: assign IVF lists once (when `assigner` is given), search
    every shard, merge with the one merge_topk."""
    prepared = prepare_vectors(queries, metric)
    query = assigner.query(prepared, k, params) if assigner else ShardQuery(prepared, k, params)
    results = [s.answer(query) for s in searchers]
    return merge_topk([r[0] for r in results], [r[1] for r in results], k, metric != "l2")


def evaluate(index_uri: str, dataset_spec: str, k: int = 10, params: dict | None = None,
             url: str | None = None, limit: int | None = None, batch_size: int = 100,
             compare_unsharded: bool = False, stream: bool | None = None,
             where: dict | None = None, num_queries: int | None = None) -> dict:
    """Recall@k against exact ground truth and QPS; optionally also the unsharded index's.

    num_queries: grade the first this many queries only (default: all; refused for a streamed
        directory, which picks its own queries).
    Parquet and .npy directories are streamed (`stream`, default: for those, unless
    `compare_unsharded`): no copy of the base set is held, only the queries and the ids.
    """
    params = params or {}
    searchers: list[ShardSearcher] = []
    assigner: CoarseAssigner | None = None
    if url:  # the server searches: only the manifest is needed here, not the shards (GBs at scale)
        manifest = read_manifest(Location.parse(index_uri))
    else:
        manifest, searchers = load_all_shards(index_uri)
        assigner = load_assigner(index_uri)
    if stream is None:
        stream = ((is_parquet_spec(dataset_spec) or is_npy_dir_spec(dataset_spec)) and not compare_unsharded
                  and where is None)
    if stream:
        if num_queries is not None:
            raise ShardserveError("num_queries: a streamed dataset picks its own queries (pass stream=False)")
        return _evaluate_streamed(manifest, searchers, assigner, dataset_spec, k, params, url, limit,
                                  batch_size)
    columns = manifest.dataset.columns()
    if where is not None and is_parquet_spec(dataset_spec):  # the columns a filter reads, as built
        columns["metadata_columns"] = manifest.dataset.metadata_columns
    dataset = load_dataset(dataset_spec, limit=limit, num_queries=num_queries, **columns)
    dataset = graded_as(dataset, manifest.metric)  # recall under the metric the index was built with
    _check_compatible(manifest, dataset.dim, len(dataset.base), dataset.name)
    if where is not None:
        return _evaluate_filtered(manifest, searchers, assigner, dataset, k, params, url, batch_size, where)
    truth = ground_truth(dataset)
    own = dataset.self_ids()  # base-only data: the queries are indexed rows, their own hit is dropped
    ids, mode, elapsed = _search(searchers, assigner, manifest, dataset.queries, k + (own is not None),
                                 params, url, batch_size)
    ids = without_self(ids, own, k)
    result = asdict(EvalResult(
        recall=round(recall_at_k(ids, dataset, k, truth), 5), k=k, queries=len(dataset.queries),
        qps=round(len(dataset.queries) / elapsed, 1), mode=mode, params=params,
        shards=len(manifest.shards), index_version=manifest.index_version))
    if compare_unsharded:
        result["unsharded"] = _evaluate_unsharded(manifest, dataset, k, params, truth)
    return result


def _search(searchers: list[ShardSearcher], assigner: CoarseAssigner | None, manifest: Manifest,
            queries: np.ndarray, k: int, params: dict, url: str | None, batch_size: int
            ) -> tuple[np.ndarray, str, float]:
    """(found ids, mode, seconds): over HTTP with `url`, else in-process as the router does."""
    start = time.perf_counter()
    if url:
        ids, mode = search_over_http(url, queries, k, params, batch_size), f"http {url}"
    else:
        ids = np.concatenate([
            sharded_search(searchers, queries[start:start + 1000], k, params, manifest.metric, assigner)[1]
            for start in progress(range(0, len(queries), 1000), "search", unit="x1000 queries")])
        mode = "in-process"
    return ids, mode, time.perf_counter() - start


def _evaluate_streamed(manifest: Manifest, searchers: list[ShardSearcher], assigner: CoarseAssigner | None,
                       spec: str, k: int, params: dict, url: str | None, limit: int | None,
                       batch_size: int) -> dict:
    """Two passes over the files, a piece at a time: the first keeps the eval queries (rows of the
    index) and the ids; after the search, the second brute-forces the exact top-k chunk by chunk
    (merged with merge_topk; cached by fingerprint, so only once per dataset and metric) and takes
    the exact distances of what the search returned, for the tie-aware recall."""
    from index_build.streaming import base_chunks, open_source, scan

    source = open_source(spec, **manifest.dataset.columns())
    scanned = scan(source, manifest.metric, np.empty(0, np.int64), limit)
    _check_compatible(manifest, scanned.dim, scanned.base_rows, source.name)
    own = scanned.ids[scanned.query_rows]  # the queries are indexed rows: their own hit is dropped
    ids, mode, elapsed = _search(searchers, assigner, manifest, scanned.queries, k + 1, params, url,
                                 batch_size)
    ids = without_self(ids, own, k)
    found_rows = rows_of(ids, scanned.ids if source.id_column else None, scanned.base_rows)
    # The exact top-k is cached by the files' fingerprint (as in-memory truth is): the second pass
    # then only takes the returned rows' exact distances as the base goes by.
    depth = min(max(k, GROUND_TRUTH_K), scanned.base_rows - 1)
    path = streamed_truth_path(source.name, scanned.fingerprint, manifest.metric, depth)
    truth = load_cached(path, (len(scanned.queries), depth))
    exact = None if truth is not None else ExactTopK(scanned.queries, depth, manifest.metric,
                                                     exclude=scanned.query_rows)
    found = FoundDistances(scanned.queries, found_rows, manifest.metric)
    for first, chunk in progress(base_chunks(source, scanned.base_rows), "exact ground truth", unit="piece"):
        if exact is not None:
            exact.add(first, chunk)
        found.add(first, chunk)
    if exact is not None:
        truth = exact.distances
        save_cached(path, truth)
    assert truth is not None
    true_kth = truth[:, min(k, depth) - 1]
    recall = recall_from_distances(found.distances, found_rows >= 0, true_kth, manifest.metric)
    return asdict(EvalResult(
        recall=round(recall, 5), k=k, queries=len(scanned.queries),
        qps=round(len(scanned.queries) / elapsed, 1), mode=f"{mode}, ground truth streamed",
        params=params, shards=len(manifest.shards), index_version=manifest.index_version))


def _evaluate_filtered(manifest: Manifest, searchers: list[ShardSearcher], assigner: CoarseAssigner | None,
                       dataset: Dataset, k: int, params: dict, url: str | None, batch_size: int,
                       where: dict) -> dict:
    """Recall@k of a filtered search against exact ground truth over the matching rows only."""
    from shardserve.query.api import ApiError
    from shardserve.query.filters import check_filter, matching

    try:
        canonical = check_filter(where, manifest.dataset.metadata_kinds)
    except ApiError as exc:
        raise ShardserveError(f"--filter: {exc.message}") from None
    if dataset.metadata is None:
        raise ShardserveError(f"--filter: dataset {dataset.name} carries no metadata columns")
    rows = np.flatnonzero(np.isin(dataset.index_ids(),
                                  matching(canonical, dataset.metadata, dataset.index_ids())))
    own = dataset.self_ids()
    if len(rows) < k + (own is not None):
        raise ShardserveError(f"--filter matches {len(rows)} rows: fewer than k={k}")
    _, found = exact_search(dataset.base[rows], dataset.queries, k + (own is not None), dataset.metric)
    truth_ids = without_self(dataset.index_ids()[rows][found], own, k)
    truth = dataset.rows_of(truth_ids)
    start = time.perf_counter()
    filtered = {**params, "filter": canonical}
    if url:
        ids, mode = search_over_http(url, dataset.queries, k + (own is not None), params, batch_size,
                                     where=where), f"http {url}"
    else:
        ids, mode = sharded_search(searchers, dataset.queries, k + (own is not None), filtered,
                                   manifest.metric, assigner)[1], "in-process"
    elapsed = time.perf_counter() - start
    ids = without_self(ids, own, k)
    result = asdict(EvalResult(
        recall=round(recall_at_k(ids, dataset, k, truth), 5), k=k, queries=len(dataset.queries),
        qps=round(len(dataset.queries) / elapsed, 1), mode=f"{mode}, filter {canonical} ({len(rows)} rows)",
        params=params, shards=len(manifest.shards), index_version=manifest.index_version))
    return {**result, "filter": where, "matching_rows": len(rows)}


def search_over_http(url: str, queries: np.ndarray, k: int, params: dict, batch_size: int = 100,
                     where: dict | None = None) -> np.ndarray:
    """Ids of the top-k of every query through the HTTP API (shardserve.client), `batch_size` a request;
    any answer but 200 is an error naming the server's message."""
    from shardserve.client import ApiError, Client

    ids = np.full((len(queries), k), -1, dtype=np.int64)
    try:
        with Client(url, timeout_s=60.0) as client:
            for start in progress(range(0, len(queries), batch_size), "search over HTTP", unit="request"):
                options: dict[str, Any] = {} if where is None else {"filter": where}
                answers = client.search_batch(queries[start:start + batch_size], k, params, **options)
                for row, hits in enumerate(answers):
                    ids[start + row, :len(hits.ids)] = hits.ids
    except ApiError as exc:
        raise ShardserveError(f"{url}: {exc}") from None
    return ids


def _check_compatible(manifest: Manifest, dim: int, base_rows: int, name: str) -> None:
    if manifest.dim != dim:
        raise ShardserveError(f"dataset {name} has dim {dim}, the index has dim {manifest.dim}")
    if manifest.num_vectors != base_rows:
        raise ShardserveError(
            f"the index holds {manifest.num_vectors} vectors, dataset {name} has "
            f"{base_rows}: pass the same --limit as the build")


def _evaluate_unsharded(manifest: Manifest, dataset: Dataset, k: int, params: dict,
                        truth: np.ndarray) -> dict:
    """Rebuild the index unsharded with the same training (same sample, same seed) and search it."""
    build = manifest.build.params
    build_params = BuildParams(manifest.index_factory, 1, manifest.metric,
                               build.get("train_size", 0), build.get("seed", 1234))
    vectors = prepare_vectors(dataset.base, manifest.metric)
    empty = train_empty_index(build_params.factory, build_params.metric,
                              training_sample(vectors, build_params), build_params.seed)
    index = add_to_copy(empty, vectors, dataset.index_ids())
    searcher = ShardSearcher(index, manifest.metric, "unsharded", "unsharded")
    start = time.perf_counter()
    own = dataset.self_ids()
    _, ids, _ = searcher.search(dataset.queries, k + (own is not None), params)
    elapsed = time.perf_counter() - start
    ids = without_self(ids, own, k)
    return {"recall": round(recall_at_k(ids, dataset, k, truth), 5),
            "qps": round(len(dataset.queries) / elapsed, 1)}
