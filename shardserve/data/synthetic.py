"""`synthetic:NxD`: a clustered Gaussian mixture, the same for the same spec on every machine."""

from __future__ import annotations

import numpy as np

from shardserve.data.dataset import Dataset, as_float32
from shardserve.errors import ShardserveError


def synthetic_vectors(num: int, dim: int, seed: int, num_clusters: int = 64) -> np.ndarray:
    """Clustered Gaussian mixture: centres from seed 0, so base and queries share clusters."""
    centres = np.random.default_rng(0).normal(0, 1, (num_clusters, dim)).astype(np.float32)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_clusters, num)
    noise = rng.normal(0, 0.35, (num, dim)).astype(np.float32)
    return as_float32(centres[labels] + noise)


def load_synthetic(spec: str) -> Dataset:
    try:
        num_text, dim_text = spec.split(":", 1)[1].lower().split("x")
        num, dim = int(num_text), int(dim_text)
    except ValueError:
        raise ShardserveError(
            f"bad synthetic spec {spec!r}: expected synthetic:NxD, e.g. synthetic:20000x64") from None
    if num < 1 or dim < 1:
        raise ShardserveError(f"bad synthetic spec {spec!r}: N and D must be >= 1")
    num_queries = max(1, min(1000, num // 10))
    return Dataset(spec, synthetic_vectors(num, dim, seed=1),
                   synthetic_vectors(num_queries, dim, seed=2), "l2")
