"""Which shard holds which base vector: whole IVF lists per shard, else row i → shard i mod S.

Why whole lists: with rows dealt round-robin, every shard holds a quarter of every inverted list, so
a query's 16 probed lists are scanned as 64 short pieces, and each piece start pays memory latency
the hardware prefetcher has not hidden yet (docs/experiments.md; `python -m lab.scan_cost` for FAISS
alone). A list lives in exactly one shard, so the set of vectors a query compares against is the
unsharded index's; merged answers stay equal.

Lists are balanced by vector count: the trained quantizer assigns the training sample (the same
seeded sample every build of the same data and params draws), the largest list goes to the lightest
shard first. Only indexes whose lists the router assigns itself (plain IVF: shardserve.query.searcher's
CoarseAssigner) are dealt by list; every other index keeps rows mod S.

Trade-off, stated in README: a shard that misses its deadline drops whole lists (the queries near
them lose most of their neighbours) where a row-dealt shard drops a quarter of every list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardserve.errors import BadArgument
from shardserve.index.assigner import CoarseAssigner
from shardserve.index.indexes import index_from_bytes

BY_LISTS, BY_ROWS = "ivf-lists", "rows"


def balanced_owners(list_sizes: np.ndarray, shards: int) -> np.ndarray:
    """Per list, its shard: largest list first onto the shard holding the fewest vectors so far
    (ties: fewer lists, then the lower shard; lists in size order, then id order): deterministic,
    and greedy's bound, the largest load within 4/3 of the best possible. Lists the sample left
    empty still spread over the shards (the data may hold a few vectors in them)."""
    load = np.zeros(shards, np.int64)
    count = np.zeros(shards, np.int64)
    owners = np.empty(len(list_sizes), np.int32)
    for lst in np.argsort(-np.asarray(list_sizes, np.int64), kind="stable"):
        shard = min(range(shards), key=lambda s: (load[s], count[s], s))
        owners[lst] = shard
        load[shard] += int(list_sizes[lst])
        count[shard] += 1
    return owners


@dataclass(frozen=True)
class Partition:
    """How a build deals base vectors to `shards` shards. `owners[l]` is list l's shard (None: by row).
    Plain data: a Ray task gets it pickled, with the trained index bytes it already has."""

    shards: int
    owners: np.ndarray | None = None

    @property
    def kind(self) -> str:
        return BY_ROWS if self.owners is None else BY_LISTS

    @classmethod
    def plan(cls, trained: bytes, sample: np.ndarray, shards: int) -> Partition:
        """Deal by list when the router can quantize for the trained index (plain IVF: query.searcher's
        CoarseAssigner, the one test of "plain IVF"), list sizes estimated on `sample` (prepared)."""
        assigner = assigner_of(trained)
        if assigner is None or shards == 1:
            return cls(shards)
        sizes = np.bincount(_nearest_list(assigner, sample), minlength=assigner.ivf.nlist)
        return cls(shards, balanced_owners(sizes, shards))

    def shard_of(self, positions: np.ndarray, vectors: np.ndarray | None = None,
                 assigner: CoarseAssigner | None = None) -> np.ndarray:
        """Each row's shard, from its base row number (`positions`) when dealing by row; by list,
        from its `vectors` (prepared: float32, normalised for cosine) and the trained index's
        `assigner` (`assigner_of(trained)`)."""
        if self.owners is None:
            return (np.asarray(positions) % self.shards).astype(np.int32)
        if vectors is None or assigner is None:
            raise BadArgument("dealing by IVF list needs the rows' vectors and the coarse quantizer")
        if len(vectors) == 0:
            return np.zeros(0, np.int32)
        return self.owners[_nearest_list(assigner, vectors)]

    def describe(self) -> dict:
        """What the manifest records: the rule, and each shard's share of lists."""
        if self.owners is None:
            return {"kind": BY_ROWS}
        return {"kind": BY_LISTS, "lists_per_shard": np.bincount(self.owners, minlength=self.shards).tolist()}


def assigner_of(trained: bytes) -> CoarseAssigner | None:
    """The coarse quantizer of a trained (empty) index, as the router holds it; None: not plain IVF."""
    return CoarseAssigner.from_trained(index_from_bytes(trained))


def _nearest_list(assigner: CoarseAssigner, vectors: np.ndarray) -> np.ndarray:
    """Each row's nearest list, as IndexIVF.add assigns it (the quantizer's own search, k=1)."""
    _, lists = assigner.quantizer.search(np.ascontiguousarray(vectors, np.float32), 1)
    return lists[:, 0]
