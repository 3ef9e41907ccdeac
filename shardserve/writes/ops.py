"""The write operations: what a validated request holds, what the log stores and what every shard
applies, in log order. Plain values, no behaviour: the parser makes them, the log keeps them, the
deltas read them.

An upsert replaces the whole point: its vector and its metadata (None: every column null), as a
new point would be; it never merges with the metadata it replaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_ID = (1 << 63) - 1  # ids are int64 >= 0, as FAISS stores them (-1 means "no result")


@dataclass(frozen=True)
class Upsert:
    id: int
    vector: np.ndarray = field(compare=False)  # float32 (dim,), prepared as the index stores it
    metadata: dict | None = None


@dataclass(frozen=True)
class Delete:
    id: int


Op = Upsert | Delete


def same_ops(a: list[Op], b: list[Op]) -> bool:
    """Equal operations, vectors compared by value (dataclass equality leaves them out)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x != y:
            return False
        if isinstance(x, Upsert) and isinstance(y, Upsert) and not np.array_equal(x.vector, y.vector):
            return False
    return True
