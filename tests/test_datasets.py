"""Dataset readers on files the tests write in each supported format; bad data is refused."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from shardserve.data.datasets import load_dataset, read_idx, read_vecs, self_query_rows
from shardserve.errors import ShardserveError


def _write_vecs(path: Path, matrix: np.ndarray) -> None:
    dim = np.full((len(matrix), 1), matrix.shape[1], dtype=np.int32)
    np.hstack([dim.view(np.uint8).reshape(len(matrix), 4),
               np.ascontiguousarray(matrix).view(np.uint8).reshape(len(matrix), -1)]).tofile(path)


def test_idx_reader_roundtrip(tmp_path: Path) -> None:
    images = np.random.default_rng(0).integers(0, 255, (5, 28, 28), dtype=np.uint8)
    path = tmp_path / "x-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as handle:
        handle.write(struct.pack(">HBB3I", 0, 8, 3, 5, 28, 28) + images.tobytes())
    np.testing.assert_array_equal(read_idx(path), images)


@pytest.mark.data
def test_fashion_mnist_is_the_real_dataset() -> None:
    dataset = load_dataset("fashion-mnist")
    assert dataset.base.shape == (60000, 784) and dataset.queries.shape == (10000, 784)
    assert dataset.metric == "l2" and dataset.base.dtype == np.float32
    assert dataset.base.min() >= 0 and dataset.base.max() <= 255


def test_ann_benchmarks_hdf5_angular_is_cosine(angular_hdf5: Path) -> None:
    dataset = load_dataset(str(angular_hdf5))
    assert dataset.metric == "cosine"
    assert dataset.base.shape == (6000, 32) and dataset.neighbors.shape == (200, 100)
    assert load_dataset(str(angular_hdf5), limit=100).neighbors is None  # stale truth dropped


def test_fvecs_with_query_and_groundtruth_siblings(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    base, queries = rng.normal(size=(300, 8)).astype(np.float32), rng.normal(size=(20, 8)).astype(np.float32)
    _write_vecs(tmp_path / "toy_base.fvecs", base)
    _write_vecs(tmp_path / "toy_query.fvecs", queries)
    _write_vecs(tmp_path / "toy_groundtruth.ivecs", np.arange(20 * 5, dtype=np.int32).reshape(20, 5))
    dataset = load_dataset(str(tmp_path / "toy_base.fvecs"))
    np.testing.assert_array_equal(dataset.base, base)
    np.testing.assert_array_equal(dataset.queries, queries)
    assert dataset.neighbors.shape == (20, 5)


def test_bvecs_reader(tmp_path: Path) -> None:
    matrix = np.random.default_rng(2).integers(0, 255, (10, 16), dtype=np.uint8)
    _write_vecs(tmp_path / "b.bvecs", matrix)
    np.testing.assert_array_equal(read_vecs(tmp_path / "b.bvecs"), matrix)


def test_npy_and_parquet_index_every_row_and_query_with_their_own_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    matrix = np.random.default_rng(3).normal(size=(500, 12)).astype(np.float32)
    np.save(tmp_path / "v.npy", matrix)
    pq.write_table(pa.table({"id": np.arange(500), "embedding": list(matrix)}), tmp_path / "v.parquet")
    from_npy, from_parquet = load_dataset(str(tmp_path / "v.npy")), load_dataset(str(tmp_path / "v.parquet"))
    own = self_query_rows(500)
    for dataset in (from_npy, from_parquet):
        np.testing.assert_array_equal(dataset.base, matrix)  # every row a user gives is indexed
        np.testing.assert_array_equal(dataset.query_rows, own)
        np.testing.assert_array_equal(dataset.queries, matrix[own])
    assert len(from_npy.queries) == 500 and len(set(own.tolist())) == 500
    limited = load_dataset(str(tmp_path / "v.npy"), limit=100, num_queries=30)
    assert len(limited.base) == 100 and limited.query_rows.max() < 100 and len(limited.queries) == 30
    np.testing.assert_array_equal(limited.queries, matrix[limited.query_rows])


def test_synthetic_is_seeded() -> None:
    a, b = load_dataset("synthetic:2000x16"), load_dataset("synthetic:2000x16")
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize("spec, message", [
    ("no-such-dataset", "unknown dataset"),
    ("synthetic:abc", "bad synthetic spec"),
    ("/nonexistent/file.npy", "not found"),
])
def test_bad_dataset_names(spec: str, message: str) -> None:
    with pytest.raises(ShardserveError, match=message):
        load_dataset(spec)


def test_nan_rows_are_refused(tmp_path: Path) -> None:
    matrix = np.ones((100, 4), np.float32)
    matrix[42, 1] = np.nan
    np.save(tmp_path / "nan.npy", matrix)
    with pytest.raises(ShardserveError, match="NaN/Inf"):
        load_dataset(str(tmp_path / "nan.npy"))


def test_empty_file_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "empty.npy", np.zeros((0, 8), np.float32))
    with pytest.raises(ShardserveError, match="empty"):
        load_dataset(str(tmp_path / "empty.npy"))
