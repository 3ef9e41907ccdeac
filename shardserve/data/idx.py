"""Fashion-MNIST, as Debian's dataset-fashion-mnist ships it: gzipped IDX files (and the labels, a
metadata column to filter on)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from shardserve import settings
from shardserve.data.dataset import Dataset, as_float32
from shardserve.errors import ShardserveError


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into an array of its declared shape."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        zero, dtype_code, ndim = struct.unpack(">HBB", handle.read(4))
        if zero != 0 or dtype_code != 0x08:
            raise ShardserveError(f"{path}: not an unsigned-byte IDX file")
        shape = struct.unpack(f">{ndim}I", handle.read(4 * ndim))
        data = np.frombuffer(handle.read(), dtype=np.uint8)
    if data.size != int(np.prod(shape)):
        raise ShardserveError(f"{path}: truncated IDX file ({data.size} of {np.prod(shape)} bytes)")
    return data.reshape(shape)


def load_fashion_mnist() -> Dataset:
    """From $SHARDSERVE_FASHION_MNIST (shardserve.settings), else Debian's directory."""
    directory = settings.fashion_mnist_dir()
    train, test = (directory / f"{n}-images-idx3-ubyte.gz" for n in ("train", "t10k"))
    if not train.exists() or not test.exists():
        raise ShardserveError(
            f"Fashion-MNIST not found in {directory}: "
            "run `sudo apt-get install dataset-fashion-mnist` (or `make data`)"
        )
    base = read_idx(train)
    queries = read_idx(test)
    labels = directory / "train-labels-idx1-ubyte.gz"
    metadata = None
    if labels.exists():  # the 10 classes, a real metadata column to filter on
        import pyarrow as pa

        metadata = pa.table({"label": pa.array(read_idx(labels).astype(np.int64))})
    return Dataset("fashion-mnist", as_float32(base.reshape(len(base), -1)),
                   as_float32(queries.reshape(len(queries), -1)), "l2", metadata=metadata)
