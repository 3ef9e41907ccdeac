"""Loading a dataset: every supported format becomes one `Dataset` of float32 base and query matrices,
sliced (--limit, --num-queries) and validated here, read by one module per format:

    idx (Fashion-MNIST), synthetic, glove, npy, hdf5 (ann-benchmarks), vecs (SIFT/GIST), parquet
    (local files and pyarrow URIs); the model in dataset, the path and glob rules in paths.

Readers are plain numpy so they are testable without Ray; the Ray Data job takes the matrices from here.
The names other modules import from here are re-exported below.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardserve.data.dataset import (
    BASE_ONLY_METRIC,
    METRICS,
    QUERY_SEED,
    SELF_QUERIES,
    Dataset,
    VectorRows,
    as_float32,
    base_only,
    check_ids,
    rows_of,
    self_query_rows,
)
from shardserve.data.glove import hold_out, load_glove50
from shardserve.data.hdf5 import ANN_BENCHMARKS_DISTANCE, read_ann_benchmarks_hdf5
from shardserve.data.idx import load_fashion_mnist, read_idx
from shardserve.data.npy import is_npy_dir_spec, load_npy, load_npy_dir, npy_files, open_npy
from shardserve.data.parquet import (
    is_parquet_spec,
    load_parquet,
    parquet_arrays,
    parquet_columns,
    parquet_files,
    read_parquet_file,
)
from shardserve.data.paths import check_same_dim, dataset_name, is_uri
from shardserve.data.synthetic import load_synthetic, synthetic_vectors
from shardserve.data.vecs import load_vecs, read_vecs
from shardserve.errors import ShardserveError

__all__ = [
    "ANN_BENCHMARKS_DISTANCE", "BASE_ONLY_METRIC", "METRICS", "QUERY_SEED",
    "SELF_QUERIES", "VECTOR_FILE_SUFFIXES", "Dataset", "VectorRows", "as_float32", "base_only",
    "check_ids", "check_same_dim", "dataset_name", "hold_out", "is_npy_dir_spec", "is_parquet_spec",
    "is_uri", "load_dataset", "npy_files", "open_npy", "parquet_arrays", "parquet_columns",
    "parquet_files", "read_ann_benchmarks_hdf5", "read_idx", "read_parquet_file", "read_vecs",
    "rows_of", "self_query_rows", "synthetic_vectors",
]

VECTOR_FILE_SUFFIXES = (".npy", ".fvecs", ".bvecs", ".parquet", ".hdf5", ".h5")


def load_dataset(spec: str, limit: int | None = None, num_queries: int | None = None,
                 vector_column: str | None = None, id_column: str | None = None,
                 metadata_columns: list[str] | None = None) -> Dataset:
    """Load a dataset by name (`fashion-mnist`, `synthetic:NxD`, `glove-50`) or by path: a file, or
    a directory or glob of parquet files or of .npy files (read in name order).

    limit: keep only the first `limit` base vectors (shipped ground truth is then dropped).
    num_queries: keep only the first `num_queries` queries.
    vector_column / id_column: parquet columns of the vectors (default: the first list column) and of
    the user's int64 ids (default: none, the index returns row numbers).
    metadata_columns: parquet columns kept per row, returned on request (`include`).
    """
    if (vector_column or id_column or metadata_columns) and not is_parquet_spec(spec):
        raise ShardserveError("--vector-column/--id-column/--metadata-columns apply to parquet data, "
                              f"not {spec!r}")
    if is_parquet_spec(spec):
        dataset = load_parquet(spec, vector_column, id_column, metadata_columns or [])
    elif is_npy_dir_spec(spec):
        dataset = load_npy_dir(spec)
    elif spec == "fashion-mnist":
        dataset = load_fashion_mnist()
    elif spec.startswith("synthetic:"):
        dataset = load_synthetic(spec)
    elif spec == "glove-50":
        dataset = load_glove50()
    elif Path(spec).suffix.lower() in VECTOR_FILE_SUFFIXES or Path(spec).is_file():
        dataset = _load_file(Path(spec))
    else:
        raise ShardserveError(
            f"unknown dataset {spec!r}: use fashion-mnist, synthetic:NxD, glove-50 or a path to "
            f"{', '.join(VECTOR_FILE_SUFFIXES)}"
        )
    return _validated(_sliced(dataset, limit, num_queries))


def _load_file(path: Path) -> Dataset:
    if not path.exists():
        raise ShardserveError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".hdf5", ".h5"):
        return read_ann_benchmarks_hdf5(path)
    if suffix in (".fvecs", ".bvecs"):
        return load_vecs(path)
    if suffix == ".npy":
        return load_npy(path)
    raise ShardserveError(f"{path}: unsupported file type {suffix!r}")


def _sliced(dataset: Dataset, limit: int | None, num_queries: int | None) -> Dataset:
    base, queries, neighbors = dataset.base, dataset.queries, dataset.neighbors
    ids, metadata, own = dataset.ids, dataset.metadata, dataset.query_rows
    if limit is not None:
        if limit < 1:
            raise ShardserveError(f"--limit must be >= 1, got {limit}")
        if limit < len(base):
            base, neighbors = base[:limit], None
            ids = None if ids is None else ids[:limit]
            metadata = None if metadata is None else metadata.slice(0, limit)
            if own is not None:  # the queries are rows of the base: pick them among the rows kept
                own = self_query_rows(limit)
                queries = base[own]
    if num_queries is not None and num_queries < len(queries):
        queries = queries[:num_queries]
        neighbors = None if neighbors is None else neighbors[:num_queries]
        own = None if own is None else own[:num_queries]
    return Dataset(dataset.name, np.ascontiguousarray(base), np.ascontiguousarray(queries),
                   dataset.metric, neighbors, None if ids is None else np.ascontiguousarray(ids), metadata,
                   own)


def _validated(dataset: Dataset) -> Dataset:
    """Refuse data no index should be built from: empty, ragged, or with NaN/Inf rows."""
    for part in ("base", "queries"):
        matrix = getattr(dataset, part)
        if matrix.ndim != 2 or matrix.shape[0] == 0 or matrix.shape[1] == 0:
            raise ShardserveError(f"dataset {dataset.name}: {part} is empty (shape {matrix.shape})")
        bad_rows = np.flatnonzero(~np.isfinite(matrix).all(axis=1))
        if bad_rows.size:
            raise ShardserveError(
                f"dataset {dataset.name}: {bad_rows.size} {part} rows contain NaN/Inf "
                f"(first at row {bad_rows[0]})"
            )
    if dataset.base.shape[1] != dataset.queries.shape[1]:
        raise ShardserveError(
            f"dataset {dataset.name}: base dim {dataset.base.shape[1]} != "
            f"query dim {dataset.queries.shape[1]}"
        )
    if dataset.metric not in METRICS:
        raise ShardserveError(f"dataset {dataset.name}: unknown metric {dataset.metric!r}")
    if dataset.ids is not None:
        check_ids(dataset.name, dataset.ids, len(dataset.base))
    return dataset
