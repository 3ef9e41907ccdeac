"""Vectors by (model, exact text): a hit is the vector the model computed, bit for bit.

Keyed by the model identity's sha256, so two models never share an entry and a model replaced by a
different file misses. Bounded by bytes (shardserve.query.cache.ByteBoundedCache, least recently
used first): an entry counts its text, its vector and what Python holds around them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shardserve.embed.model_files import ModelIdentity
from shardserve.query.cache import ByteBoundedCache

# What Python holds for an entry besides the text's str and the vector's data: the key tuple, the
# array object, the (vector, truncated) and (value, size) tuples and the ordered-dict slot.
# Sized for 384-dim float32 vectors; tests/test_embed.py checks that the real growth stays under
# the counted bytes.
ENTRY_OVERHEAD = 480


class _Embeds(Protocol):
    """What the cache needs of an embedder (shardserve.embed.model.Embedder)."""

    @property
    def identity(self) -> ModelIdentity: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


@dataclass
class Lookup:
    """`EmbeddingCache.lookup`'s answer for a request's texts: the hits found, and the distinct
    texts the model must still embed (`missing`, in first-asked order), each with its rows."""

    model: str
    texts: Sequence[str]
    found: list[tuple[np.ndarray, bool] | None]  # per row: (vector, truncated) of a hit
    missing: dict[str, list[int]] = field(default_factory=dict)


class EmbeddingCache:
    """Thread-safe. `hits` and `misses` count lookups since the cache was made.

    Arguments:
        max_bytes: the bound on everything the entries hold (see `entry_bytes`); 0 keeps nothing
            (every lookup a miss).
    """

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes = max_bytes
        self._entries = ByteBoundedCache(max_bytes, max_entries=sys.maxsize)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, model: str, text: str) -> np.ndarray | None:
        """The cached vector (read-only) of `text` under the model whose identity sha256 is `model`."""
        entry = self._get(model, text)
        return None if entry is None else entry[0]

    def put(self, model: str, text: str, vector: np.ndarray, truncated: bool = False) -> None:
        """Keep a copy of `vector`: a row of a caller's batch would hold the whole batch alive.
        `truncated`: the model read only its token limit of `text`."""
        if self.max_bytes <= 0:
            return
        kept = np.array(vector, dtype=np.float32, copy=True)
        kept.flags.writeable = False
        self._entries.put((model, text), (kept, truncated), entry_bytes(text, kept))

    def lookup(self, model: str, texts: Sequence[str]) -> Lookup:
        """Each text's hit, and the distinct texts missing (to embed, then `complete`)."""
        found = [self._get(model, text) for text in texts]
        lookup = Lookup(model, texts, found)
        for row, (text, entry) in enumerate(zip(texts, found, strict=True)):
            if entry is None:
                lookup.missing.setdefault(text, []).append(row)
        return lookup

    def complete(self, lookup: Lookup, fresh: np.ndarray | None, fresh_truncated: Sequence[int] = (),
                 dim: int | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
        """(float32 (len(texts), dim), the rows whose texts were truncated) from the hits and `fresh`,
        the vectors of `lookup.missing`'s texts in its order (positions in it listed in
        `fresh_truncated`), which are kept."""
        if fresh is not None:
            dim = fresh.shape[1]
        else:
            dim = dim if dim is not None else next(e for e in lookup.found if e is not None)[0].shape[0]
        vectors = np.empty((len(lookup.texts), dim), np.float32)
        truncated = set()
        for row, entry in enumerate(lookup.found):
            if entry is not None:
                vectors[row] = entry[0]
                if entry[1]:
                    truncated.add(row)
        if fresh is not None:
            cut = set(fresh_truncated)
            pairs = zip(lookup.missing.items(), fresh, strict=True)
            for position, ((text, rows), vector) in enumerate(pairs):
                vectors[rows] = vector
                if position in cut:
                    truncated.update(rows)
                self.put(lookup.model, text, vector, position in cut)
        return vectors, tuple(sorted(truncated))

    def embed(self, embedder: _Embeds, texts: Sequence[str]) -> np.ndarray:
        """float32 (len(texts), dim): hits from the cache, the misses (each distinct text once) embedded
        in one call and kept."""
        if not texts:
            return embedder.embed([])
        lookup = self.lookup(embedder.identity.sha256, texts)
        fresh = embedder.embed(list(lookup.missing)) if lookup.missing else None
        return self.complete(lookup, fresh)[0]

    def _get(self, model: str, text: str) -> tuple[np.ndarray, bool] | None:
        entry = self._entries.get((model, text))
        with self._lock:
            if entry is None:
                self.misses += 1
            else:
                self.hits += 1
        return entry

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
