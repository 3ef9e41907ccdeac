"""The TEXMEX .fvecs/.bvecs/.ivecs files of SIFT and GIST (as faiss contrib's vecs_io reads them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardserve.data.dataset import Dataset, as_float32, base_only
from shardserve.errors import ShardserveError


def read_vecs(path: Path) -> np.ndarray:
    """Read .fvecs (float32), .bvecs (uint8) or .ivecs (int32).

    Each row is a little-endian int32 dimension followed by that many values.
    """
    item = {".fvecs": np.float32, ".bvecs": np.uint8, ".ivecs": np.int32}[path.suffix.lower()]
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size < 4:
        raise ShardserveError(f"{path}: empty vector file")
    dim = int(raw[:4].view(np.int32)[0])
    row_bytes = 4 + dim * np.dtype(item).itemsize
    if dim <= 0 or raw.size % row_bytes:
        raise ShardserveError(f"{path}: corrupt {path.suffix} file (dim {dim}, {raw.size} bytes)")
    rows = raw.reshape(-1, row_bytes)
    if not (rows[:, :4].view(np.int32)[:, 0] == dim).all():
        raise ShardserveError(f"{path}: rows of different dimension")
    return np.ascontiguousarray(rows[:, 4:]).view(item).reshape(len(rows), dim)


def load_vecs(path: Path) -> Dataset:
    """SIFT/GIST layout: NAME_base.fvecs with NAME_query.fvecs and NAME_groundtruth.ivecs beside it."""
    base = as_float32(read_vecs(path))
    stem = path.stem.removesuffix("_base")
    query_path = path.with_name(f"{stem}_query{path.suffix}")
    truth_path = path.with_name(f"{stem}_groundtruth.ivecs")
    if path.stem.endswith("_base") and query_path.exists():
        queries = as_float32(read_vecs(query_path))
        neighbors = read_vecs(truth_path).astype(np.int64) if truth_path.exists() else None
        return Dataset(stem, base, queries, "l2", neighbors)
    return base_only(stem, base)
