"""Vectors by (model, exact text): a hit is the vector the model computed, bit for bit.

Keyed by the model identity's sha256, so two models never share an entry and a model replaced by a
different file misses. Bounded by bytes (shardserve.query.cache.ByteBoundedCache, least recently
used first): an entry counts its text, its vector and what Python holds around them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from shardserve.embed.model_files import ModelIdentity
from shardserve.query.cache import ByteBoundedCache

# What Python holds for an entry besides the text's str and the vector's data: the key tuple, the
# array object, the cache's (value, size) tuple and its ordered-dict slot. Measured with tracemalloc
# for 384-dim float32 vectors (tests/test_embed.py holds the real growth under the counted bytes).
ENTRY_OVERHEAD = 400


class _Embeds(Protocol):
    """What the cache needs of an embedder (shardserve.embed.model.Embedder)."""

    @property
    def identity(self) -> ModelIdentity: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


class EmbeddingCache:
    """Thread-safe. `hits` and `misses` count lookups since the cache was made.

    Arguments:
        max_bytes: the bound on everything the entries hold (see `entry_bytes`).
    """

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self._entries = ByteBoundedCache(max_bytes, max_entries=sys.maxsize)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, model: str, text: str) -> np.ndarray | None:
        """The cached vector (read-only) of `text` under the model whose identity sha256 is `model`."""
        vector = self._entries.get((model, text))
        with self._lock:
            if vector is None:
                self.misses += 1
            else:
                self.hits += 1
        return vector

    def put(self, model: str, text: str, vector: np.ndarray) -> None:
        """Keep a copy of `vector`: a row of a caller's batch would hold the whole batch alive."""
        kept = np.array(vector, dtype=np.float32, copy=True)
        kept.flags.writeable = False
        self._entries.put((model, text), kept, entry_bytes(text, kept))

    def embed(self, embedder: _Embeds, texts: Sequence[str]) -> np.ndarray:
        """float32 (len(texts), dim): hits from the cache, the misses (each distinct text once) embedded
        in one call and kept."""
        if not texts:
            return embedder.embed([])
        model = embedder.identity.sha256
        found = [self.get(model, text) for text in texts]
        missing: dict[str, list[int]] = {}
        for row, (text, vector) in enumerate(zip(texts, found, strict=True)):
            if vector is None:
                missing.setdefault(text, []).append(row)
        fresh = embedder.embed(list(missing)) if missing else None
        dim = fresh.shape[1] if fresh is not None else next(v for v in found if v is not None).shape[0]
        vectors = np.empty((len(texts), dim), np.float32)
        for row, vector in enumerate(found):
            if vector is not None:
                vectors[row] = vector
        if fresh is not None:
            for (text, rows), vector in zip(missing.items(), fresh, strict=True):
                vectors[rows] = vector
                self.put(model, text, vector)
        return vectors

    @property
    def nbytes(self) -> int:
        return self._entries.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        with self._lock:
            hits, misses = self.hits, self.misses
        return {"hits": hits, "misses": misses, "entries": len(self), "bytes": self.nbytes,
                "max_bytes": self.max_bytes}


def entry_bytes(text: str, vector: np.ndarray) -> int:
    """The bytes one entry counts against the bound: the text's str object, the vector's data and
    ENTRY_OVERHEAD."""
    return sys.getsizeof(text) + vector.nbytes + ENTRY_OVERHEAD
