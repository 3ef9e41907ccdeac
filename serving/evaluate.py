"""`shardserve eval`: recall@k and QPS of a sharded index, in-process or over the HTTP API.

In-process eval runs every shard's search and the router's `merge_topk`, so a recall measured here is
the recall the service returns; `--url` measures the service itself.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from core.datasets import Dataset, load_dataset
from core.errors import ShardserveError
from core.groundtruth import graded_as, ground_truth, recall_at_k
from core.indexes import add_to_copy, prepare_vectors, train_empty_index
from core.manifest import Manifest
from core.merge import merge_topk
from core.searcher import CoarseAssigner, ShardSearcher, load_all_shards, load_assigner
from core.shard_wire import ShardQuery
from index_build.publish import BuildParams, training_sample


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
             compare_unsharded: bool = False) -> dict:
    """Recall@k against exact ground truth and QPS; optionally also the unsharded index's."""
    params = params or {}
    manifest, searchers = load_all_shards(index_uri)
    assigner = load_assigner(index_uri)
    dataset = load_dataset(dataset_spec, limit=limit, **manifest.dataset.columns())
    dataset = graded_as(dataset, manifest.metric)  # recall under the metric the index was built with
    _check_compatible(manifest, dataset)
    truth = ground_truth(dataset)
    if url:
        from serving.http_client import search_over_http

        start = time.perf_counter()
        ids = search_over_http(url, dataset.queries, k, params, batch_size)
        mode = f"http {url}"
    else:
        start = time.perf_counter()
        _, ids = sharded_search(searchers, dataset.queries, k, params, manifest.metric, assigner)
        mode = "in-process"
    elapsed = time.perf_counter() - start
    result = asdict(EvalResult(
        recall=round(recall_at_k(ids, dataset, k, truth), 5), k=k, queries=len(dataset.queries),
        qps=round(len(dataset.queries) / elapsed, 1), mode=mode, params=params,
        shards=len(searchers), index_version=manifest.index_version))
    if compare_unsharded:
        result["unsharded"] = _evaluate_unsharded(manifest, dataset, k, params, truth)
    return result


def _check_compatible(manifest: Manifest, dataset: Dataset) -> None:
    if manifest.dim != dataset.dim:
        raise ShardserveError(
            f"dataset {dataset.name} has dim {dataset.dim}, the index has dim {manifest.dim}")
    if manifest.num_vectors != len(dataset.base):
        raise ShardserveError(
            f"the index holds {manifest.num_vectors} vectors, dataset {dataset.name} has "
            f"{len(dataset.base)}: pass the same --limit as the build")


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
    _, ids, _ = searcher.search(dataset.queries, k, params)
    elapsed = time.perf_counter() - start
    return {"recall": round(recall_at_k(ids, dataset, k, truth), 5),
            "qps": round(len(dataset.queries) / elapsed, 1)}
