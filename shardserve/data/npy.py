"""NumPy .npy files: one file, or a directory (or glob) of them read in name order (autofaiss's
input layout). Base-only: eval's queries are some of the rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardserve.data.dataset import Dataset, as_float32, base_only
from shardserve.data.paths import check_same_dim, dataset_name, holds, is_glob, local_files
from shardserve.errors import ShardserveError


def open_npy(path: Path) -> np.ndarray:
    """A .npy file memory-mapped (nothing read yet), checked: a 2-D array of real numbers. Never
    unpickled: object arrays are refused."""
    try:
        matrix = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ShardserveError(f"{path}: not a numeric .npy array ({exc})") from None
    if not isinstance(matrix, np.ndarray) or matrix.dtype.kind not in "fiu":
        kind = getattr(matrix, "dtype", type(matrix).__name__)
        raise ShardserveError(f"{path}: expected real numbers (float or int), got {kind}")
    if matrix.ndim != 2:
        raise ShardserveError(f"{path}: expected a 2-D array, got shape {matrix.shape}")
    return matrix


def is_npy_dir_spec(spec: str) -> bool:
    """A directory of .npy embedding files (autofaiss's input layout) or a glob of them."""
    if is_glob(spec):
        return spec.endswith(".npy")
    return holds(Path(spec), ".npy") and not holds(Path(spec), ".parquet")


def npy_files(spec: str) -> list[Path]:
    """The .npy files of a directory or glob, in name order (their rows are numbered in that order)."""
    files = local_files(spec, ".npy")
    if not files:
        raise ShardserveError(f"no .npy files match {spec!r}")
    return files


def load_npy_dir(spec: str) -> Dataset:
    """Every .npy file, in name order, as one base-only matrix (the streaming build reads the same
    rows chunk by chunk: index_build.streaming.NpySource)."""
    matrices = [open_npy(path) for path in npy_files(spec)]
    check_same_dim(spec, matrices)
    return base_only(dataset_name(spec), np.concatenate([as_float32(m) for m in matrices]))


def load_npy(path: Path) -> Dataset:
    return base_only(path.stem, open_npy(path))
