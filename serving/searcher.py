"""Search one shard: the plain object a Serve shard replica (or in-process eval) wraps."""

from __future__ import annotations

import time

import faiss
import numpy as np

from index_build.indexes import index_from_bytes, prepare_vectors, search_params
from index_build.manifest import Manifest, read_manifest, read_shard_checked
from index_build.storage import Location


class ShardSearcher:
    """One shard's FAISS index, loaded after its sha256 check, searched with per-request params."""

    def __init__(self, index: faiss.Index, metric: str, name: str, index_version: str):
        self.index = index
        self.metric = metric
        self.name = name
        self.index_version = index_version

    @classmethod
    def load(cls, location: Location, manifest: Manifest, shard: int) -> ShardSearcher:
        entry = manifest.shards[shard]
        index = index_from_bytes(read_shard_checked(location, entry))
        return cls(index, manifest.metric, entry.name, manifest.index_version)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    def search(self, queries: np.ndarray, k: int, params: dict | None = None,
               prepared: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
        """Top-k of a query matrix → (distances, ids, search milliseconds).

        `prepared=True` means the caller already normalised (cosine) and made the matrix float32.
        """
        matrix = queries if prepared else prepare_vectors(queries, self.metric)
        faiss_params = search_params(self.index, params)
        start = time.perf_counter()
        distances, ids = self.index.search(matrix, k, params=faiss_params)
        return distances, ids, (time.perf_counter() - start) * 1000.0


def load_all_shards(uri: str) -> tuple[Manifest, list[ShardSearcher]]:
    location = Location.parse(uri)
    manifest = read_manifest(location)
    return manifest, [ShardSearcher.load(location, manifest, s) for s in range(len(manifest.shards))]
