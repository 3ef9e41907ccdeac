"""Which shard's delta holds an upserted point: a deterministic rule every shard applies to every
request of the log, so each knows, without asking, whether a point is its own.

The replicas and compaction route every upsert by a hash of its id (splitmix64: spreads sequential
ids evenly), whatever the build's dealing: the manifest does not keep the build's partition. The
rule can also follow a dealing by whole IVF lists (a point to the shard owning its vector's nearest
list, as the build would have placed it) when given the quantizer; nothing uses that yet. An
overwrite whose new home differs from the old one moves the point: the old shard hides its copy (a
tombstone, or drops its delta row), the new one holds it, and a search's shards may answer on
either side of the move (the router keeps the newest copy: shardserve.query.merge). The rule
depends only on the request, never on what a shard holds.
"""

from __future__ import annotations

import numpy as np

from shardserve.errors import BadArgument
from shardserve.index.assigner import CoarseAssigner
from shardserve.index.partition import Partition

_MASK = (1 << 64) - 1


def splitmix64(ids: np.ndarray) -> np.ndarray:
    """A well-mixed uint64 of each id (Steele et al.'s finaliser), vectorised."""
    z = np.asarray(ids, np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def splitmix64_int(id_: int) -> int:
    """splitmix64 of one id in Python integers: a replica applies most requests one point at a
    time, and numpy's per-call overhead is ten times this."""
    z = (id_ + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class WriteRoute:
    """`shard_of(ids, vectors)`: each upserted point's shard (vectors prepared as the index stores
    them: float32, normalised for cosine)."""

    def __init__(self, partition: Partition, assigner: CoarseAssigner | None = None):
        if partition.owners is not None and assigner is None:
            raise BadArgument("an index dealt by IVF list routes writes by list: it needs the quantizer")
        self.partition, self.assigner = partition, assigner

    @property
    def shards(self) -> int:
        return self.partition.shards

    @property
    def by_id(self) -> bool:
        """Points go home by their id alone (`home_of`), not by their vector."""
        return self.partition.owners is None

    def home_of(self, id_: int) -> int:
        """One point's shard when routed by id (`by_id`): shard_of's answer, without numpy."""
        return splitmix64_int(id_) % self.shards

    def shard_of(self, ids: np.ndarray, vectors: np.ndarray) -> np.ndarray:
        if self.partition.owners is not None:
            return self.partition.shard_of(np.asarray(ids), np.ascontiguousarray(vectors, np.float32),
                                           self.assigner)
        return (splitmix64(ids) % np.uint64(self.shards)).astype(np.int32)
