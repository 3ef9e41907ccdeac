"""ann-benchmarks HDF5 files: `train`, `test`, optional `neighbors` (shipped ground truth), and the
`distance` attribute (the metric)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardserve.data.dataset import Dataset, as_float32
from shardserve.errors import ShardserveError

ANN_BENCHMARKS_DISTANCE = {"euclidean": "l2", "angular": "cosine", "dot": "ip", "ip": "ip"}


def read_ann_benchmarks_hdf5(path: Path) -> Dataset:
    """ann-benchmarks layout: `train`, `test`, optional `neighbors`, attribute `distance`."""
    import h5py

    try:
        with h5py.File(path, "r") as handle:
            missing = [key for key in ("train", "test") if key not in handle]
            if missing:
                raise ShardserveError(f"{path}: not an ann-benchmarks file (missing {missing})")
            distance = str(handle.attrs.get("distance", "euclidean"))
            if distance not in ANN_BENCHMARKS_DISTANCE:
                raise ShardserveError(f"{path}: unsupported distance {distance!r}")
            neighbors = np.asarray(handle["neighbors"], dtype=np.int64) if "neighbors" in handle else None
            num_train = len(handle["train"])
            if neighbors is not None and neighbors.size and (neighbors.min() < 0
                                                             or neighbors.max() >= num_train):
                raise ShardserveError(f"{path}: 'neighbors' holds ids outside [0, {num_train}) "
                                      f"(min {neighbors.min()}, max {neighbors.max()})")
            return Dataset(path.stem, as_float32(handle["train"]), as_float32(handle["test"]),
                           ANN_BENCHMARKS_DISTANCE[distance], neighbors)
    except OSError as exc:
        raise ShardserveError(f"{path}: cannot read HDF5 ({exc})") from None
