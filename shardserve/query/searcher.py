"""Search one shard (with the router's IVF list assignments, which shardserve.index.assigner makes
once for all shards): the plain object a shard replica wraps, and in-process eval uses the same way."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import faiss
import numpy as np

from shardserve.errors import BadArgument
from shardserve.index.indexes import index_from_bytes, prepare_vectors, search_params, unwrap_id_map
from shardserve.index.manifest import Manifest, read_manifest, read_shard_checked, shard_file_checked
from shardserve.index.metadata import MetadataTable
from shardserve.index.storage import Location, cache_root
from shardserve.query.cache import ByteBoundedCache
from shardserve.query.filter_plan import FilterPlan, both_selected, plan_filter
from shardserve.query.filters import cache_key, filter_bytes, matching
from shardserve.query.half_scan import KEPT_FACTOR, FallbackGate, HalfCopy
from shardserve.query.list_scan import search_by_lists
from shardserve.query.scan_choice import ScanChoice
from shardserve.transport.shard_wire import QueryBounds, ShardQuery

__all__ = ["Exclusion", "FilterPlan", "ShardSearcher", "both_selected", "load_all_shards"]


# IVF-Flat shards choose a batch's scan by the bytes it reads (query.scan_choice: list by list, each
# list read once for all its queries, or FAISS's own query by query). From LIST_ORDER_ROWS rows, a
# batch scanned query by query runs its rows in order of their lowest-numbered list, so queries that
# share lists run back to back while those lists are still in cache (other IVF codes too).
GATHERED_KEPT = 8  # filters whose matching vectors a shard keeps gathered (in all, <= its own rows)
# Per-filter state a replica keeps for the filter's next batches, each cache bounded by bytes: the
# matching ids (8 bytes a row) and the selectors over them (a hash set or a bitmap).
SELECTED_BYTES = 64 << 20
SELECTOR_BYTES = 64 << 20
LIST_ORDER_ROWS = 64
# A list-by-list scan holds every (row, probe, k+1) candidate of its batch at once: past this, the
# batch is scanned query by query (a heap of k a row). 1,024 rows of 128 dimensions, 64 probes held
# each and the half-precision copy's 200 candidates (k 100) would hold ~635 MB: scanned query by
# query; with 20 candidates (k 10) and 32 probes, ~48 MB.
POOL_BYTES = 256 << 20


@dataclass(frozen=True)
class Exclusion:
    """Rows of the base index a search must leave out: a delta's tombstones at one log position
    (shardserve.writes), built by shardserve.writes.tombstones for this index's kind. `selector`
    keeps the others, over what this index's scan sees (ids for IVF, inner rows for an IndexIDMap2);
    `held` is what it reads (a FAISS selector does not own its buffers): alive with the exclusion."""

    ids: np.ndarray  # the excluded ids (distinct)
    selector: faiss.IDSelector
    held: tuple = field(default=(), repr=False)


class ShardSearcher:
    """One shard's FAISS index, loaded after its sha256 check, searched with per-request params."""

    def __init__(self, index: faiss.Index, metric: str, name: str, index_version: str):
        self.index = index
        self.metric = metric
        self.name = name
        self.index_version = index_version
        inner = faiss.downcast_index(index)
        self.ivf: faiss.IndexIVF | None = inner if isinstance(inner, faiss.IndexIVF) else None
        self._ivf_params: dict[int, faiss.SearchParametersIVF] = {}
        self.list_order_rows = LIST_ORDER_ROWS
        # IVF-Flat only: its scans are bound by reading the lists (other codes are small, and their
        # per-list tables would be built once per pair instead of once per query).
        flat = self.ivf if type(self.ivf) is faiss.IndexIVFFlat else None
        self.scan_choice = None if flat is None else ScanChoice.of(flat)
        # the lists this shard holds: the probes a shard dealt by lists can skip
        self.nonempty = None if self.scan_choice is None else self.scan_choice.list_bytes > 0
        self.half: HalfCopy | None = None  # a half-precision copy of the lists (make_half_copy)
        self.half_gate = FallbackGate()  # does a batch scan the copy first?
        self.metadata: MetadataTable | None = None  # this shard's rows' metadata, for filters
        self._selected = ByteBoundedCache(SELECTED_BYTES)  # filter -> ids of its matching rows
        self._gathered: dict[str, faiss.Index] = {}  # filter -> flat index of its matching vectors
        self._gathered_lock = threading.Lock()
        self._direct_map_lock = threading.Lock()
        self._ids: np.ndarray | None = None  # an IndexIDMap2's id of each inner row
        # filter -> its FAISS selector and the buffer it points into: built once per filter, not per
        # batch (an IDSelectorBatch hashes every matching id). A FAISS selector does not own that
        # buffer: every search holds the pair until FAISS returns, so an eviction by another thread's
        # filter cannot free it mid-scan.
        self._selectors = ByteBoundedCache(SELECTOR_BYTES)

    @classmethod
    def load(cls, location: Location, manifest: Manifest, shard: int, mmap: bool = True,
             half_copy: bool = True) -> ShardSearcher:
        """`mmap=True`: FAISS maps the file instead of reading it (`IO_FLAG_MMAP`): IVF lists stay
        in the page cache, shared by every replica of the shard on the node, so a replica starts
        without copying them and holds them once. Other index types are read into memory as
        before (FAISS ignores the flag for them); fast-scan IVF lists are copied too.
        `half_copy`: make_half_copy where the lists outgrow the core's cache."""
        entry = manifest.shards[shard]
        if mmap:
            # a shard on remote storage (s3://, ...) is downloaded once per node, then memory-mapped
            path = shard_file_checked(location, entry, cache_root())
            index = faiss.read_index(path, faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
        else:
            index = index_from_bytes(read_shard_checked(location, entry))
        searcher = cls(index, manifest.metric, entry.name, manifest.index_version)
        if half_copy:
            searcher.make_half_copy()
        if manifest.metadata is not None:  # what `include` returns and filters read
            searcher.metadata = MetadataTable.load(location, manifest.metadata[shard])
        return searcher

    def make_half_copy(self) -> bool:
        """Where the IVF-Flat lists are larger than the core's cache, a scan is bound by reading
        them: keep a half-precision copy to scan, answered with FAISS's float32 distances
        (query.half_scan). It also gives the index a direct map (an id's place in its lists), which
        FAISS will not merge: not for an index to be merged or cloned. Was a copy made?"""
        flat = self.ivf if type(self.ivf) is faiss.IndexIVFFlat else None
        memory_bound = self.scan_choice is not None and self.scan_choice.memory_bound
        if self.half is None and flat is not None and memory_bound:
            self.half = HalfCopy.of(flat)
        return self.half is not None

    @property
    def mmapped(self) -> bool:
        """Are the IVF lists served from the mapped file (not copied into this process)?"""
        lists = None if self.ivf is None else self.ivf.invlists
        return lists is not None and isinstance(faiss.downcast_InvertedLists(lists),
                                                faiss.OnDiskInvertedLists)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    def query_bounds(self, *, max_rows: int, max_k: int, params: frozenset[str]) -> QueryBounds:
        """What this shard accepts off the wire (transport.shard_wire checks a batch against it)."""
        ivf = faiss.try_extract_index_ivf(unwrap_id_map(self.index))
        return QueryBounds(dim=self.dim, nlist=0 if ivf is None else int(ivf.nlist), max_rows=max_rows,
                           max_k=max_k, params=params)

    def search(self, queries: np.ndarray, k: int, params: dict | None = None,
               prepared: bool = False, exclude: Exclusion | None = None
               ) -> tuple[np.ndarray, np.ndarray, float]:
        """Top-k of a query matrix → (distances, ids, search milliseconds).

        `prepared=True` means the caller already normalised (cosine) and made the matrix float32.
        `exclude`: rows left out (a delta's tombstones).
        """
        matrix = queries if prepared else prepare_vectors(queries, self.metric)
        start = time.perf_counter()
        if exclude is None:
            distances, ids = self.index.search(matrix, k, params=search_params(self.index, params))
        else:
            distances, ids = self._search_sel(np.ascontiguousarray(matrix, np.float32), k, params or {},
                                              exclude.selector)
        return distances, ids, (time.perf_counter() - start) * 1000.0

    def answer(self, query: ShardQuery, exclude: Exclusion | None = None) -> tuple:
        """A router batch: scan only the lists the router assigned when it did (IVF), else search.
        With a `filter` param: (distances, ids, ms, rows matched), see `answer_filtered`.
        `exclude`: rows left out (a delta's tombstones: shardserve.writes.shard answers with them)."""
        if "filter" in query.params:
            return self.answer_filtered(query, exclude)
        if query.assign is None:
            return self.search(query.matrix, query.k, query.params, prepared=True, exclude=exclude)
        if self.ivf is None:
            raise BadArgument(f"shard {self.name} is not a plain IVF index: it cannot take list assignments")
        matrix = np.ascontiguousarray(query.matrix, np.float32)
        assign = np.ascontiguousarray(query.assign, np.int64)
        coarse = np.ascontiguousarray(query.coarse, np.float32)
        sel = None if exclude is None else exclude.selector
        start = time.perf_counter()
        if self.half is None or not self.half_gate.use():
            distances, ids = self._scan_choosing(self.ivf, matrix, assign, coarse, query.k, sel)
        else:  # candidates from the half-precision copy, answered with FAISS's own distances
            found_d, found_i = self._scan_choosing(self.half.index, matrix, assign, coarse,
                                                   KEPT_FACTOR * query.k, sel, settle_ties=False)
            distances, ids, again = self.half.rerank(matrix, found_d, found_i, query.k, self.metric != "l2",
                                                     assign)
            self.half_gate.record(len(matrix), len(again))
            if len(again):  # not settled by the copy's bound, or tied at the k-th: FAISS's own scan
                distances[again], ids[again] = self._scan(matrix[again], assign[again], coarse[again],
                                                          query.k, sel)
        return distances, ids, (time.perf_counter() - start) * 1000.0

    def answer_filtered(self, query: ShardQuery, exclude: Exclusion | None = None
                        ) -> tuple[np.ndarray, np.ndarray, float, int]:
        """A batch under a metadata filter: only the shard's rows that match are candidates (a FAISS
        selector, so the scan skips the others), planned by selectivity s = matched / rows
        (`filter_plan`). `exclude`: rows left out (a delta's tombstones), of the matched and the
        rows both."""
        params = dict(query.params)
        where = params.pop("filter")
        start = time.perf_counter()
        selected = self.selected(where)
        n, k = len(query.matrix), query.k
        matched, rows = len(selected), int(self.index.ntotal)
        if exclude is not None:
            matched -= int(np.isin(selected, exclude.ids, assume_unique=True).sum())
            rows -= len(exclude.ids)
        if not matched:
            worst = -np.inf if self.metric != "l2" else np.inf
            return (np.full((n, k), worst, np.float32), np.full((n, k), -1, np.int64),
                    (time.perf_counter() - start) * 1000.0, 0)
        plan = self.filter_plan(query, params, matched / max(rows, 1))
        distances, ids = self.search_by_plan(query, where, selected, plan, exclude)
        return distances, ids, (time.perf_counter() - start) * 1000.0, matched

    def filter_plan(self, query: ShardQuery, params: dict, share: float) -> FilterPlan:
        """The plan for a batch under a filter `share` of this shard's rows match (query.filter_plan)."""
        return plan_filter(self.index, self.ivf is not None, query, params, share)

    def search_by_plan(self, query: ShardQuery, where: str, selected: np.ndarray, plan: FilterPlan,
                       exclude: Exclusion | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The filtered batch searched the way `plan` says, `exclude`'s rows left out."""
        if plan.kind == "exact":
            return self._exact_among(query.matrix, query.k, where, selected, exclude)
        if plan.kind == "routed":
            assert query.assign is not None and query.coarse is not None
            held = self._selector(where, selected)  # alive until FAISS returns
            both = held[0] if exclude is None else both_selected(held[0], exclude.selector)
            return self._scan(np.ascontiguousarray(query.matrix, np.float32),
                              np.ascontiguousarray(query.assign[:, :plan.probe], np.int64),
                              np.ascontiguousarray(query.coarse[:, :plan.probe], np.float32), query.k, both)
        return self.search_selected(query.matrix, query.k, where, selected, plan.params, exclude)

    def search_selected(self, matrix: np.ndarray, k: int, where: str, selected: np.ndarray, params: dict,
                        exclude: Exclusion | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The index's own search at `params` (no planning), its candidates only the `selected` ids
        (those of filter `where`): what answer_filtered runs above EXACT_SHARE, once it has widened
        the params. Sharded, merged, it equals the unsharded index's at the same params (tests)."""
        held = self._selector(where, selected)  # the selector and its buffer, alive until FAISS returns
        sel = held[0] if exclude is None else both_selected(held[0], exclude.selector)
        return self._search_sel(np.ascontiguousarray(matrix, np.float32), k, params, sel)

    def _search_sel(self, matrix: np.ndarray, k: int, params: dict, sel: faiss.IDSelector
                    ) -> tuple[np.ndarray, np.ndarray]:
        """The index's own search, candidates only what `sel` keeps (ids for IVF, inner rows for an
        IndexIDMap2); the caller keeps `sel` and its buffers alive."""
        if not isinstance(self.index, faiss.IndexIDMap):  # IVF: the lists hold the ids themselves
            return self.index.search(matrix, k, params=search_params(self.index, params, sel))
        # An IndexIDMap2 (Flat, HNSW, refined IVF): the inner index knows rows 0..n-1 only, and it
        # translates a selector itself only at the top level, which IndexRefine does not pass on to
        # its base index: select the inner rows here, search the inner index, name the answers.
        inner = unwrap_id_map(self.index)
        distances, rows = inner.search(matrix, k, params=search_params(inner, params, sel))
        return distances, np.where(rows >= 0, self._id_map()[np.maximum(rows, 0)], -1)

    def _selector(self, where: str, selected: np.ndarray) -> tuple[faiss.IDSelector, np.ndarray]:
        """The filter's selector and the buffer it reads, kept for its next batches: over ids for
        IVF (its lists hold the ids), a bitmap over the inner rows for an IndexIDMap2 (rows 0..n-1: a
        bit test per row). The caller holds the pair for as long as FAISS may read it."""
        kept = self._selectors.get(where)
        if kept is None:
            if not isinstance(self.index, faiss.IndexIDMap):
                kept = (faiss.IDSelectorBatch(selected), selected)
                size = 24 * len(selected)  # FAISS's hash set of the ids, about
            else:  # a pass over every id of the shard, once per filter
                bits = np.packbits(np.isin(self._id_map(), selected), bitorder="little")
                kept = (faiss.IDSelectorBitmap(len(self._id_map()), faiss.swig_ptr(bits)), bits)
                size = bits.nbytes
            self._selectors.put(where, kept, size + filter_bytes(where))
        return kept

    def _id_map(self) -> np.ndarray:
        """External id of each inner row of an IndexIDMap2 (read once)."""
        if self._ids is None:
            self._ids = faiss.vector_to_array(self.index.id_map).astype(np.int64)  # type: ignore[attr-defined]
        return self._ids

    def _exact_among(self, matrix: np.ndarray, k: int, where: str, selected: np.ndarray,
                     exclude: Exclusion | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Brute force over the matching rows' stored vectors, gathered once per filter (cached):
        a flat index of them answers the whole batch with BLAS. `exclude`d rows stay in the
        gathered vectors (they depend on the filter only): asked for as many more, then dropped."""
        flat = self._gathered.get(where)
        if flat is None:
            flat = faiss.IndexFlat(int(self.index.d), self.index.metric_type)
            flat.add(self._vectors(selected))
            # at most GATHERED_KEPT filters, together at most as many rows as the shard (a copy of
            # its vectors at worst), the oldest dropped first; a search holding one keeps it alive
            with self._gathered_lock:
                while self._gathered and (len(self._gathered) >= GATHERED_KEPT or sum(
                        int(f.ntotal) for f in self._gathered.values()) + len(selected) > self.index.ntotal):
                    self._gathered.pop(next(iter(self._gathered)))
                self._gathered[where] = flat
        dropped = 0 if exclude is None else int(np.isin(selected, exclude.ids, assume_unique=True).sum())
        distances, rows = flat.search(np.ascontiguousarray(matrix, np.float32),
                                      min(k + dropped, len(selected)))
        ids = np.where(rows >= 0, selected[np.maximum(rows, 0)], -1)
        if dropped:  # the kept ones in their order (the excluded last, as missing), then the first k
            gone = np.isin(ids, exclude.ids)  # type: ignore[union-attr]
            order = np.argsort(gone, axis=1, kind="stable")[:, :k]
            ids, distances = np.take_along_axis(ids, order, 1), np.take_along_axis(distances, order, 1)
            ids[np.take_along_axis(gone, order, 1)] = -1
            distances[ids < 0] = -np.inf if self.metric != "l2" else np.inf
        if ids.shape[1] < k:  # fewer matching rows than k: padded as FAISS pads
            worst = -np.inf if self.metric != "l2" else np.inf
            pad = k - ids.shape[1]
            ids = np.hstack([ids, np.full((len(ids), pad), -1, np.int64)])
            distances = np.hstack([distances, np.full((len(ids), pad), worst, np.float32)])
        return distances, ids

    def stored_vectors(self, ids: np.ndarray) -> np.ndarray:
        """The vectors the index holds for these ids (each one it holds; a lossy index's decoded
        codes, not what was added). Thread-safe."""
        return self._vectors(ids)

    def _vectors(self, ids: np.ndarray) -> np.ndarray:
        """The stored vectors of these ids (IVF: through its direct map, made on first use; an
        IndexIDMap2, Flat, HNSW or refined index: by id)."""
        if self.ivf is not None:
            # ids are the user's, not sequential: a hash map from id to its place in the lists, made
            # once (two threads making it at once would each rebuild it under the other's reads)
            with self._direct_map_lock:
                if self.ivf.direct_map.type == faiss.DirectMap.NoMap:  # type: ignore[attr-defined]
                    self.ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
            return self.ivf.reconstruct_batch(ids)
        return self.index.reconstruct_batch(ids)

    def filter_ready(self, where: str) -> bool:
        """Is what a filter's next batch needs already made (its matching rows, and its selector or
        gathered vectors)? A shard searches a new filter's first batch off its event loop."""
        return where in self._selected and (where in self._selectors or where in self._gathered)

    def selected(self, where: str) -> np.ndarray:
        """The ids of this shard's rows that pass a (checked) filter; the recent ones are cached."""
        if self.metadata is None:
            raise BadArgument(f"shard {self.name} holds no metadata to filter on")
        found = self._selected.get(cache_key(where))
        if found is None:
            found = matching(where, self.metadata.table, self.metadata.ids, self.metadata.postings)
            self._selected.put(where, found, found.nbytes + filter_bytes(where))
        return found

    def _scan_choosing(self, ivf: faiss.IndexIVF, matrix: np.ndarray, assign: np.ndarray, coarse: np.ndarray,
                       k: int, sel: faiss.IDSelector | None, settle_ties: bool = True
                       ) -> tuple[np.ndarray, np.ndarray]:
        """`ivf`'s top k of a preassigned batch, list by list or query by query (query.scan_choice).
        `settle_ties`: rows tied at the k-th distance list by list are scanned again the FAISS way
        (the half-precision copy's candidates need not be: query.half_scan bounds what they miss)."""
        n = len(matrix)
        if self.nonempty is not None and self.scan_choice is not None and self.scan_choice.by_lists(assign) \
                and self._pool_bytes(assign, k) <= POOL_BYTES:
            one_probe = self._params(1) if sel is None else faiss.SearchParametersIVF(nprobe=1, sel=sel)
            distances, ids, again = search_by_lists(ivf, self.nonempty, matrix, assign, coarse, k,
                                                    self.metric != "l2", one_probe)
            if settle_ties and len(again):  # a tie at the k-th distance: FAISS's own scan decides
                distances[again], ids[again] = self._scan(matrix[again], assign[again], coarse[again], k,
                                                          sel, ivf)
            return distances, ids
        if n >= self.list_order_rows:  # rows by their lowest list: neighbours scan lists still in cache
            order = np.argsort(assign.min(axis=1), kind="stable")
            distances, ids = np.empty((n, k), np.float32), np.empty((n, k), np.int64)
            distances[order], ids[order] = self._scan(matrix[order], assign[order], coarse[order], k,
                                                      sel, ivf)
            return distances, ids
        return self._scan(matrix, assign, coarse, k, sel, ivf)

    def _pool_bytes(self, assign: np.ndarray, k: int) -> int:
        """What a list-by-list scan of this batch holds at once (query.list_scan), about: each pair
        (a row and a probe the shard holds) its query vector and k+1 candidates (a float32 and an
        int64); the pool of every row's pairs, the widest row setting the width, three times over
        (the pool, and the merge's copies and sort)."""
        assert self.nonempty is not None
        held = self.nonempty[assign]
        width = int(held.sum(axis=1).max(initial=0))
        pairs = int(held.sum())
        return pairs * (4 * self.dim + 12 * (k + 1)) + 3 * len(assign) * width * (k + 1) * 12

    def _params(self, nprobe: int) -> faiss.SearchParametersIVF:
        params = self._ivf_params.get(nprobe)
        if params is None:  # one per nprobe, kept: a SWIG object made per call costs every search CPU
            params = self._ivf_params[nprobe] = faiss.SearchParametersIVF(nprobe=nprobe)
        return params

    def _scan(self, matrix: np.ndarray, assign: np.ndarray, coarse: np.ndarray,
              k: int, sel: faiss.IDSelector | None = None, ivf: faiss.IndexIVF | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """FAISS's query-by-query scan of the assigned lists; arrays C-contiguous float32 / int64 /
        float32 (the C++ call: FAISS's Python wrapper takes no SearchParameters here, and nprobe must
        come from the request, never from mutating the shared index). `sel`: only those ids. `ivf`:
        the index scanned (the shard's own, or its half-precision copy)."""
        ivf = self.ivf if ivf is None else ivf
        assert ivf is not None  # answer() routes only IVF shards here
        n, nprobe = assign.shape
        params = self._params(nprobe) if sel is None else faiss.SearchParametersIVF(nprobe=nprobe, sel=sel)
        distances = np.empty((n, k), np.float32)
        ids = np.empty((n, k), np.int64)
        ivf.search_preassigned_c(n, faiss.swig_ptr(matrix), k, faiss.swig_ptr(assign),  # type: ignore[attr-defined]
                                 faiss.swig_ptr(coarse), faiss.swig_ptr(distances),
                                 faiss.swig_ptr(ids), False, params)
        return distances, ids


def load_all_shards(uri: str, mmap: bool = True) -> tuple[Manifest, list[ShardSearcher]]:
    """`mmap=False` when the indexes will be cloned or merged (FAISS cannot clone mapped lists,
    nor merge an index with the direct map a half-precision copy needs: none is made)."""
    location = Location.parse(uri)
    manifest = read_manifest(location)
    return manifest, [ShardSearcher.load(location, manifest, s, mmap, half_copy=mmap)
                      for s in range(len(manifest.shards))]
