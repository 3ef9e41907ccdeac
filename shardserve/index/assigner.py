"""The shared IVF coarse quantizer: which lists a query probes, computed once per batch for every
shard (the router runs it; the build deals whole lists to shards with it)."""

from __future__ import annotations

import hashlib

import faiss
import numpy as np

from shardserve.index.indexes import index_from_bytes, unwrap_id_map
from shardserve.index.manifest import Manifest, read_manifest, read_shard_checked
from shardserve.index.storage import Location
from shardserve.transport.shard_wire import ShardQuery

# Filtered search's plan (shardserve.query.searcher.answer_filtered), shared by router and shards:
# a shard compares the query with each matching row when at most EXACT_SHARE of its rows match, and
# else probes FILTER_WIDEN x nprobe / share lists. Under a filter the router ranks the most lists a
# shard can then take, and each takes its prefix: the quantizer runs once, as unfiltered.
# Chosen on Fashion-MNIST's labels (a filter that follows the clusters), graded in
# tests/test_serving.py and test_filters.py; lab.filter_plan records each plan's cost.
EXACT_SHARE = 0.25
FILTER_WIDEN = 4.0


def filtered_nprobe(nprobe: int, share: float, nlist: int) -> int:
    """The lists a shard probes under a filter that `share` of its rows match (> EXACT_SHARE)."""
    return min(nlist, int(np.ceil(FILTER_WIDEN * nprobe / max(share, EXACT_SHARE))))


def _key(where: str) -> bytes:
    """A filter's fixed-size key: a filter may be 256 KB, and thousands are kept."""
    return hashlib.blake2b(where.encode(), digest_size=16).digest()


class FilterShares:
    """The share of each shard's rows a filter matched, learned from the shards' answers (each
    reports the rows it matched): with it the router ranks only the lists some shard will take.
    Every shard comparing exactly (each share <= EXACT_SHARE): no lists, no quantizer. Otherwise the
    most that a shard's own share asks for (`filtered_nprobe`), not the most any share could.
    One index version's shards hold fixed rows, so a share, once learned, holds; at most `kept`
    filters are kept, the one learned first dropped first."""

    def __init__(self, rows_per_shard: list[int], kept: int = 4096):
        self.rows = [max(int(rows), 1) for rows in rows_per_shard]
        self.kept = kept
        self._shares: dict[bytes, tuple[float, ...]] = {}

    def learn(self, where: str, matched: list[int | None]) -> None:
        """The rows each shard matched (None: that shard did not answer, nothing is learned)."""
        counts = [m for m in matched if m is not None]
        if _key(where) in self._shares or len(counts) != len(self.rows):
            return
        if len(self._shares) >= self.kept:
            del self._shares[next(iter(self._shares))]
        self._shares[_key(where)] = tuple(m / rows for m, rows in zip(counts, self.rows, strict=True))

    def lists(self, where: str, nprobe: int, nlist: int) -> int | None:
        """The lists to rank for `where` at `nprobe`: 0 when every shard compares exactly (or none
        matches), else the most a shard's share asks for; None when the filter is not yet learned."""
        shares = self._shares.get(_key(where))
        if shares is None:
            return None
        wide = [filtered_nprobe(nprobe, share, nlist) for share in shares if share > EXACT_SHARE]
        return max(wide, default=0)


class CoarseAssigner:
    """The shared IVF coarse quantizer, run ONCE per batch by the router instead of once per shard.

    Every shard was trained from the same empty index, so the lists it assigns are the lists each
    shard would pick itself: answers stay identical to the unsharded index. Only for plain IVF
    indexes (no pre-transform, no refine); others keep the per-shard search.
    """

    def __init__(self, ivf: faiss.IndexIVF, owner: faiss.Index):
        self._owner = owner  # keeps the C++ objects `ivf` and its quantizer point into alive
        self.ivf = ivf
        self.quantizer = faiss.downcast_index(ivf.quantizer)
        self.default_nprobe = int(ivf.nprobe)

    @classmethod
    def from_trained(cls, trained: faiss.Index) -> CoarseAssigner | None:
        inner = unwrap_id_map(trained)
        return cls(inner, trained) if isinstance(inner, faiss.IndexIVF) else None

    @classmethod
    def load(cls, location: Location, manifest: Manifest) -> CoarseAssigner | None:
        """From the manifest's trained empty index; None for non-IVF indexes or older builds."""
        if manifest.trained is None:
            return None
        return cls.from_trained(index_from_bytes(read_shard_checked(location, manifest.trained)))

    def query(self, matrix: np.ndarray, k: int, params: dict, shares: FilterShares | None = None
              ) -> ShardQuery:
        """The batch with its lists assigned (matrix prepared: float32, normalised for cosine),
        nearest first. Under a filter, each shard takes the prefix its own share of matching rows
        asks for: as many as the `shares` learned say the shards take (none: no assignment at all),
        or, for a filter not learned yet, as many as any shard may probe (filtered_nprobe at
        EXACT_SHARE)."""
        nlist = int(self.ivf.nlist)
        nprobe = min(int(params.get("nprobe", self.default_nprobe)), nlist)
        if "filter" in params:
            learned = None if shares is None else shares.lists(params["filter"], nprobe, nlist)
            if learned == 0:  # every shard compares the query with its matching rows: no lists
                return ShardQuery(matrix, k, params)
            nprobe = filtered_nprobe(nprobe, EXACT_SHARE, nlist) if learned is None else learned
        coarse, assign = self.quantizer.search(matrix, nprobe)
        return ShardQuery(matrix, k, params, assign, coarse)


def load_assigner(uri: str) -> CoarseAssigner | None:
    location = Location.parse(uri)
    return CoarseAssigner.load(location, read_manifest(location))
