"""Which scan a shard runs for an IVF-Flat batch, chosen by the bytes the batch reads.

FAISS scans a batch query by query: a list probed by several queries of the batch is read once per
query. The list-by-list scan (query.list_scan) reads each list once for all its queries, at a fixed
cost per (query, list) pair (a call row, a k+1 heap, the merge of each query's pairs). It pays where
what query by query reads again would not still be in the core's cache when read again: a list
larger than the core's own cache is evicted by its own scan before the next query needs it.

Counted per batch, from the shard's list sizes and its code size:
- `pair_bytes`: what the batch reads query by query (every pair reads its whole list);
- `distinct_bytes`: what it reads list by list (each list once);
- `read_again` = pair_bytes - distinct_bytes.

List by list where the batch reads each of its lists READS_PER_LIST times or more on average if they
outgrow the core's cache (`outgrows_cache`), READS_PER_CACHED_LIST times if they stay in it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from shardserve.index.manifest import Manifest

_L2_FALLBACK = 1 << 20  # where sysfs does not say (1 MiB: a common server core's L2)
# A list still in the core's L2 when the batch's next query reads it must fit in this share of it:
# its own scan also streams ids, queries and heaps through the cache, the core runs the router and
# the other shards between two reads, and L2 is no perfect LRU. It keeps what the records show: lists
# of 0.18 of the L2 stay in it (60K x 784 on a 1 MiB L2: query by query cost least), lists of 1.9 of
# it do not (4M x 128: list by list and the half-precision copy paid). A list of 0.95 of the L2 (4M
# on a 2 MiB L2) is counted as evicted; no host of that kind has been recorded here.
RESIDENT_SHARE = 0.5


SYS_CPU = Path("/sys/devices/system/cpu")


def outgrows_cache(list_bytes: float, cache: int) -> bool:
    """Is a list of `list_bytes` evicted from a core's L2 of `cache` bytes by the time a scan reads
    it again (RESIDENT_SHARE)? Then a scan is bound by reading lists from memory."""
    return list_bytes > cache * RESIDENT_SHARE


def cache_bytes(cpu: int = 0, sys_cpu: Path = SYS_CPU) -> int:
    """The unified L2 cache of one core, from sysfs (Linux), else 1 MiB. Why sysfs and not a
    library: psutil does not report caches, py-cpuinfo runs a subprocess to find out; this is two
    small files the kernel writes."""
    root = sys_cpu / f"cpu{cpu}" / "cache"
    try:
        for entry in sorted(root.glob("index*")):
            level, kind = ((entry / name).read_text().strip() for name in ("level", "type"))
            if level == "2" and kind != "Instruction":
                size = (entry / "size").read_text().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
                return int(size.rstrip("KMG")) * scale
    except (OSError, ValueError):
        pass
    return _L2_FALLBACK


# List by list from this many reads of the batch's lists each, on average (pair_bytes /
# distinct_bytes), where lists are larger than the core's cache: with fewer, reading a list once for
# its queries saves less than the list-by-list scan's own overhead costs. Fitted with
# `python -m lab.scan_choice` (docs/experiments.md).
READS_PER_LIST = 1.5
# ... and where they fit in it. In-process, alone on its core, a shard scanning lists that fit finds
# them still in cache query by query, and list by list costs more CPU; served, the core is shared
# with the router and the other shards, and only batches that read each list many times gain from
# list by list (docs/experiments.md).
READS_PER_CACHED_LIST = 4.0


@dataclass(frozen=True)
class Counted:
    pairs: int
    pair_bytes: int
    distinct_bytes: int

    @property
    def read_again(self) -> int:
        return self.pair_bytes - self.distinct_bytes


class ScanChoice:
    """One shard's choice (its base index's lists never change: writes go to a delta). `forced`:
    True / False always / never list by list (labs and tests), None: by the bytes."""

    def __init__(self, list_bytes: np.ndarray, cache: int | None = None):
        self.list_bytes = list_bytes.astype(np.int64)
        held = self.list_bytes[self.list_bytes > 0]
        self.mean_list_bytes = float(held.mean()) if len(held) else 0.0
        self.cache = cache_bytes() if cache is None else cache
        self.reads_per_list = READS_PER_LIST if self.memory_bound else READS_PER_CACHED_LIST
        self.forced: bool | None = None

    @property
    def memory_bound(self) -> bool:
        """Do the lists outgrow the core's cache on average (a scan bound by reading them)?"""
        return outgrows_cache(self.mean_list_bytes, self.cache)

    @classmethod
    def of(cls, ivf: faiss.IndexIVF, cache: int | None = None) -> ScanChoice:
        lists = ivf.invlists
        assert lists is not None, "an IVF index without inverted lists"
        sizes = np.array([lists.list_size(number) for number in range(ivf.nlist)], np.int64)
        return cls(sizes * int(ivf.code_size), cache)

    def count(self, assign: np.ndarray) -> Counted:
        """The batch's pairs and bytes (`assign`: the router's (n, nprobe) lists; -1 is no list)."""
        probed = assign[assign >= 0]
        sizes = self.list_bytes[probed]
        seen = np.zeros(len(self.list_bytes), bool)
        seen[probed] = True
        return Counted(int((sizes > 0).sum()), int(sizes.sum()), int(self.list_bytes[seen].sum()))

    def by_lists(self, assign: np.ndarray) -> bool:
        """Scan this batch list by list? Where the batch reads its lists often enough to amortise the
        pairs' cost: more often where they stay in the core's cache between two reads."""
        if self.forced is not None:
            return self.forced
        if len(assign) < self.reads_per_list:
            return False  # no list can be read that often: nothing to count
        counted = self.count(assign)
        if not counted.distinct_bytes:
            return False  # none of the probed lists is held here
        return counted.pair_bytes >= self.reads_per_list * counted.distinct_bytes


_IVF_FLAT = re.compile(r"IVF(\d+)(?:_[A-Za-z0-9]+)?,Flat")


def batches_share_lists(index_factory: str, num_vectors: int, dim: int, cache: int | None = None) -> bool:
    """Do the index's IVF-Flat lists outgrow a core's cache on average? Then a shard scans a
    batch list by list (reading each list once for all its queries) and a larger batch shares more
    of the scan: what the router's batch fill (query.batcher) waits for pays. At 60K (lists ~180
    KB, in cache) the scan is query by query and the fill's wait only idles the shards."""
    found = _IVF_FLAT.fullmatch(index_factory.replace(" ", ""))
    if found is None or not int(found.group(1)):
        return False
    list_bytes = num_vectors * dim * 4 / int(found.group(1))
    return outgrows_cache(list_bytes, cache_bytes() if cache is None else cache)


def shares_scan(manifest: Manifest) -> bool:
    """Does a batch share each shard's scan of this index (batches_share_lists)? Then the router
    fills batches and runs one per shard replica (deployments.config.AppArgs), and the edge lets
    in the batch 128 waiting clients make (serving.edge.default_admission)."""
    return batches_share_lists(manifest.index_factory, manifest.num_vectors, manifest.dim)
