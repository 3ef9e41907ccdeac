"""What multi-file sources share: telling a glob or a URI from a path, listing a directory's or a
glob's files in name order (their rows are numbered in that order), naming the dataset, one dim."""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np

from shardserve.errors import ShardserveError


def is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def is_uri(spec: str) -> bool:
    return "://" in spec


def local_files(spec: str, suffix: str) -> list[Path]:
    """The files of a glob, or a directory's *`suffix` files, in name order (maybe none)."""
    if is_glob(spec):
        return sorted(Path(p) for p in glob.glob(spec))
    return sorted(Path(spec).glob(f"*{suffix}"))


def holds(path: Path, suffix: str) -> bool:
    """A directory with at least one *`suffix` file."""
    return path.is_dir() and any(path.glob(f"*{suffix}"))


def dataset_name(spec: str) -> str:
    """A multi-file dataset's name: a glob's or a directory's directory name, a file's stem."""
    trimmed = spec.partition("?")[0].rstrip("/") if is_uri(spec) else spec.rstrip("/")
    last = trimmed.rsplit("/", 1)
    if is_glob(last[-1]) and len(last) == 2:
        trimmed = last[0]
    path = Path(trimmed)
    return (path.stem if path.suffix.lower() in (".parquet", ".npy") else path.name) or "dataset"


def check_same_dim(spec: str, matrices: list[np.ndarray]) -> int:
    """The one dimension of every file of a multi-file dataset (parquet or .npy), else a clear error."""
    dims = sorted({m.shape[1] for m in matrices})
    if len(dims) != 1:
        raise ShardserveError(f"{spec}: files hold vectors of different dimensions {dims}")
    return dims[0]
