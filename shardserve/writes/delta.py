"""A shard's delta tier: the writes applied on top of its immutable base index, in log order.

Why a delta and not FAISS's own add/remove: shard files are read-only maps (IO_FLAG_MMAP |
IO_FLAG_READ_ONLY), shared by every replica of the shard on a node; FAISS refuses add_with_ids and
remove_ids on them. So each replica keeps, in memory:
- the points upserted since the base was built whose home (shardserve.writes.route) is this shard,
  with their metadata, in a small FAISS index of the base's own kind: for plain IVF a copy of the
  trained empty index the shards were built from (same quantizer, same codes, so a delta point is
  found exactly when the unsharded index would find it, with the same distance); otherwise an
  exact flat index, whose rows are the delta's rows;
- tombstones: base ids deleted, overwritten or moved away (shardserve.writes.tombstones).

Every shard applies every request of the log, in order: a shard needs to know when a point it holds
(in its base or its delta) is deleted or overwritten anywhere. `apply` is idempotent for positions
already applied, so a replica replaying the log after a restart, or a retried delivery, is harmless.
A point lives in the delta at most once, so an id is answered at most once, with its latest vector
and metadata: an overwrite or a delete kills the point's previous row, a bit cleared (`LiveRows`;
the IVF delta's lists, which hold ids, drop it through their hash map). Dead rows stay, left out of
every search, until a repack copies the live rows to new arrays: once the dead pass REPACK_SHARE of
the live ones (or the arrays are full), so a repack comes after as many writes as it copies rows.

Filters read the delta's metadata as arrow columns, built from the points' dicts only for the rows
written since a filter last needed them; each filter's matching rows are kept (bounded by bytes,
the least recently used dropped first) and brought up to date the same way: a write costs the next
filtered search its own rows, not the delta's.

Memory is bounded by `max_rows` live rows of vectors (plus the dead ones not yet reclaimed); past it
`apply` refuses the request (DeltaFull), whole, before changing anything: the router answers 503 +
Retry-After until compaction makes room. Tombstones are bounded by the base's rows (only base ids
are tombstoned).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import faiss
import numpy as np
import pyarrow as pa

from shardserve.errors import BadArgument, ShardserveError
from shardserve.index.indexes import index_from_bytes, search_params
from shardserve.query.cache import ByteBoundedCache
from shardserve.query.filters import cache_key, filter_bytes, matching
from shardserve.query.searcher import FilterPlan, ShardSearcher
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.ops import Op, Upsert
from shardserve.writes.route import WriteRoute
from shardserve.writes.tombstones import LiveRows, Tombstones

MAX_DELTA_ROWS = 200_000  # per shard replica (and its bytes: writes.accept.MAX_BACKLOG_BYTES)
# Each filter's matching rows (8 bytes a row), kept for its next batches: bounded as the base's are
# (shardserve.query.searcher.SELECTED_BYTES).
MATCHED_BYTES = 64 << 20
REPACK_MIN = 1024  # dead rows a delta may hold whatever its size
REPACK_SHARE = 0.5  # and dead rows up to this share of its live ones: a flat delta scans them too


class DeltaFull(ShardserveError):
    """A request would put more rows in a shard's delta than its bound: nothing was applied."""

    def __init__(self, rows: int, adding: int, max_rows: int):
        super().__init__(f"the shard's delta holds {rows} rows, {adding} more would pass its bound of "
                         f"{max_rows}: retry once compaction has folded it into a new version")
        self.rows, self.adding, self.max_rows = rows, adding, max_rows


@dataclass(frozen=True)
class _Matched:
    """A filter's matching rows among rows [0, through), as of `kills` rows killed (ascending)."""

    through: int
    kills: int
    rows: np.ndarray


class _Columns:
    """The metadata of the delta's rows [0, built) as arrow tables, built from their dicts when a
    filter first needs them. The chunks at least halve in size from the first (the last two merge
    until they do, as a binary counter carries): a row is copied O(log rows) times, and a read joins
    O(log rows) chunks."""

    def __init__(self, schema: pa.Schema, first: pa.Table | None = None):
        self.schema = schema
        self._chunks = [] if first is None or not first.num_rows else [first]
        self.built = 0 if first is None else first.num_rows

    def extend(self, metas: list[dict | None]) -> None:
        """The next rows' metadata (None: every column null)."""
        if not metas:
            return
        columns = [pa.array([None if m is None else m.get(f.name) for m in metas], f.type)
                   for f in self.schema]
        self._chunks.append(pa.Table.from_arrays(columns, schema=self.schema))
        self.built += len(metas)
        while len(self._chunks) > 1 and self._chunks[-2].num_rows <= 2 * self._chunks[-1].num_rows:
            last = self._chunks.pop()
            self._chunks[-1] = pa.concat_tables([self._chunks[-1], last]).combine_chunks()

    def take(self, rows: np.ndarray) -> pa.Table:
        """The metadata of `rows` (each below `built`), in their order."""
        if not self._chunks:
            return self.schema.empty_table()
        return pa.concat_tables(self._chunks).take(rows)


class ShardDelta:
    """One shard replica's delta over `base`. `trained`: the manifest's trained empty index (needed
    when the base is plain IVF). Safe across threads: `lock` guards everything; a search takes it
    for the delta's part and the tombstones' snapshot (shardserve.writes.shard)."""

    def __init__(self, base: ShardSearcher, shard: int, route: WriteRoute, trained: bytes | None = None,
                 max_rows: int = MAX_DELTA_ROWS):
        self.shard, self.route, self.max_rows = shard, route, max_rows
        self.dim, self.metric = base.dim, base.metric
        self.ivf_delta = base.ivf is not None and not isinstance(base.index, faiss.IndexIDMap)
        self._packed = False
        if self.ivf_delta:
            if trained is None:
                raise BadArgument("an IVF shard's delta copies the trained empty index: pass `trained`")
            self.index = index_from_bytes(trained)
            self._ivf = faiss.extract_index_ivf(self.index)
            if self.index.ntotal or self._ivf.nlist != base.ivf.nlist:  # type: ignore[union-attr]
                raise BadArgument("`trained` is not the empty index this shard was built from")
            # fast-scan lists (blocks of packed codes) take no removal through the hash map: such a
            # delta's lists are made again from its live rows when a request kills one of them
            self._packed = isinstance(faiss.downcast_index(self._ivf), faiss.IndexIVFFastScan)
            if not self._packed:
                self._ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
        else:  # its rows are the arrays' rows below: dead ones left out by a bitmap (`_live`)
            self.index = faiss.IndexFlat(self.dim, base.index.metric_type)
        self.schema = None if base.metadata is None else base.metadata.table.schema
        self.tombstones = Tombstones(base.index)
        self.lock = threading.RLock()
        self._applied = threading.Condition(self.lock)
        self.position = 0  # the last log position applied
        self._slot: dict[int, int] = {}  # live id -> its row in the arrays below
        self._ids = np.zeros(0, np.int64)
        self._vectors = np.zeros((0, self.dim), np.float32)
        self._meta: list[dict | None] = []
        self._live = LiveRows(0)  # which rows hold a live point
        self._used = 0  # rows used, the dead ones (deleted, overwritten) until a repack
        self._kills = 0  # rows killed so far: a filter's kept rows are checked again once it moves
        self._columns = None if self.schema is None else _Columns(self.schema)
        self._matched = ByteBoundedCache(MATCHED_BYTES)  # filter -> _Matched

    @property
    def rows(self) -> int:
        """Live points in the delta."""
        return len(self._slot)

    def room(self) -> int:
        """How many more points the delta takes before it refuses (the router's backpressure)."""
        return self.max_rows - self.rows

    def apply(self, position: int, ops: list[Op], bounded: bool = True) -> bool:
        """Apply one logged request (False: `position` was applied already). `bounded=False` when
        replaying requests already acknowledged: those must be held, whatever the bound."""
        with self.lock:
            if position <= self.position:
                return False
            upserts = [op for op in ops if isinstance(op, Upsert)]
            for point in upserts:  # checked before anything changes: all or nothing
                if point.vector.shape != (self.dim,):
                    raise BadArgument(f"request {position}: a vector of shape {point.vector.shape}, "
                                      f"the index's dim is {self.dim}")
            if self.route.by_id:  # most requests hold one point: no numpy round trip
                home = [self.route.home_of(op.id) for op in upserts]
            elif upserts:
                home = self.route.shard_of(np.array([op.id for op in upserts], np.int64),
                                           np.stack([op.vector for op in upserts])).tolist()
            else:
                home = []
            adding = home.count(self.shard)
            if bounded and self.rows + adding > self.max_rows:
                raise DeltaFull(self.rows, adding, self.max_rows)
            if self._used + adding > len(self._ids):
                self._repack(self.rows + adding)
            first = self._used
            gone: list[int] = []  # ids whose previous row the delta's index holds
            homes = iter(home)
            for op in ops:
                row = self._slot.pop(op.id, None)
                if row is not None:  # its previous row is dead
                    self._live.set(row, False)
                    self._kills += 1
                    if row < first:
                        gone.append(op.id)
                self.tombstones.hide(op.id)  # a base copy is hidden for good
                if isinstance(op, Upsert) and next(homes) == self.shard:
                    row = self._used
                    self._ids[row], self._vectors[row], self._meta[row] = op.id, op.vector, op.metadata
                    self._slot[op.id] = row
                    self._live.set(row, True)
                    self._used += 1
            self._index_rows(first, gone)
            if self._used - self.rows > max(REPACK_MIN, REPACK_SHARE * self.rows):
                self._repack(self.rows)
            self.position = position
            self._applied.notify_all()
            return True

    def wait_applied(self, position: int, timeout_s: float) -> bool:
        """Block until `position` is applied (a search that must see a write), or time out."""
        with self._applied:
            return self._applied.wait_for(lambda: self.position >= position, timeout_s)

    def _index_rows(self, first: int, gone: list[int]) -> None:
        """The delta's index after a request wrote rows [first, _used) and killed `gone`'s rows."""
        if not self.ivf_delta:  # every new row, dead ones (an id written twice in a request) too
            if self._used > first:
                self.index.add(self._vectors[first:self._used])
            return
        if gone and self._packed:  # O(delta rows), for the requests that kill a delta row only
            self.index.reset()
            first = 0
        elif gone:  # found through the lists' hash map: no other row moves
            dropped = np.array(gone, np.int64)  # the selector reads it: alive through the call
            self.index.remove_ids(faiss.IDSelectorArray(dropped))
        now = first + np.flatnonzero(self._live.mask[first:self._used])
        if len(now):
            self.index.add_with_ids(self._vectors[now], self._ids[now])

    def _repack(self, live_needed: int) -> None:
        """The live rows copied to new arrays (a flat delta's index too), the dead dropped, with room
        for `live_needed` live rows (twice as many: a repack comes after as many writes as it copies)."""
        live = np.flatnonzero(self._live.mask[:self._used])
        kept, capacity = len(live), max(REPACK_MIN, 2 * live_needed)
        ids, vectors = np.zeros(capacity, np.int64), np.zeros((capacity, self.dim), np.float32)
        ids[:kept], vectors[:kept] = self._ids[live], self._vectors[live]
        self._meta = [self._meta[row] for row in live.tolist()] + [None] * (capacity - kept)
        self._ids, self._vectors = ids, vectors
        self._slot = dict(zip(ids[:kept].tolist(), range(kept), strict=True))
        self._live, self._used = LiveRows(capacity, kept), kept
        if not self.ivf_delta:
            self.index.reset()
            self.index.add(vectors[:kept])
        if self._columns is not None:  # the live rows keep their order: the built ones come first
            self._columns = _Columns(self._columns.schema,
                                     self._columns.take(live[live < self._columns.built]))
        self._matched = ByteBoundedCache(MATCHED_BYTES)  # rows renumbered: each filter starts again

    def points(self) -> tuple[np.ndarray, np.ndarray, list[dict | None]]:
        """The live points (ids, vectors, metadata), as upserted: what compaction folds in."""
        with self.lock:
            rows = np.flatnonzero(self._live.mask[:self._used])
            return self._ids[rows], self._vectors[rows], [self._meta[r] for r in rows.tolist()]

    def metadata_of(self, id_: int) -> tuple[bool, dict | None]:
        """(is the id in the delta, its metadata)."""
        with self.lock:
            row = self._slot.get(id_)
            return (False, None) if row is None else (True, self._meta[row])

    def matching_rows(self, where: str) -> np.ndarray:
        """The delta's live rows whose (latest) metadata pass a checked filter, ascending; caller
        holds `lock`. Kept per filter, and brought up to date by the rows written since."""
        if self._columns is None:
            raise BadArgument("this shard holds no metadata to filter on")
        kept: _Matched | None = self._matched.get(cache_key(where))
        if kept is not None and kept.through == self._used and kept.kills == self._kills:
            return kept.rows
        through, rows = (0, np.zeros(0, np.int64)) if kept is None else (kept.through, kept.rows)
        if kept is not None and kept.kills != self._kills:
            rows = rows[self._live.mask[rows]]
        new = through + np.flatnonzero(self._live.mask[through:self._used])
        if len(new):
            self._columns.extend(self._meta[self._columns.built:self._used])
            ids = self._ids[new]
            found = matching(where, self._columns.take(new), ids)
            rows = np.concatenate([rows, new[np.isin(ids, found, assume_unique=True)]])
        self._matched.put(where, _Matched(self._used, self._kills, rows), rows.nbytes + filter_bytes(where))
        return rows

    def matching(self, where: str) -> np.ndarray:
        """The live delta ids whose (latest) metadata pass a checked filter; caller holds `lock`."""
        return self._ids[self.matching_rows(where)]

    def live_ids(self) -> np.ndarray:
        """Every live id of the delta, in no order; caller holds `lock`."""
        return self._ids[np.flatnonzero(self._live.mask[:self._used])]

    def point(self, id_: int) -> tuple[np.ndarray, dict | None] | None:
        """(its vector, its metadata) for a live id of the delta, else None; caller holds `lock`."""
        row = self._slot.get(id_)
        return None if row is None else (self._vectors[row], self._meta[row])

    def search(self, query: ShardQuery, plan: FilterPlan | None = None,
               matched: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The delta's top-k of a batch, unfiltered (`plan` None) or the way the shard's filter
        `plan` searches its base, among the `matched` delta rows (matching_rows); caller holds `lock`."""
        n, k = len(query.matrix), query.k
        matrix = np.ascontiguousarray(query.matrix, np.float32)
        if not self.rows or (plan is not None and (matched is None or not len(matched))):
            return self._missing(n, k)
        if not self.ivf_delta:
            return self._search_flat(matrix, k, plan, matched)
        params = dict(query.params) if plan is None else dict(plan.params)
        params.pop("filter", None)
        if plan is None:
            if query.assign is not None and query.coarse is not None:
                return self._preassigned(matrix, query.assign, query.coarse, k, None)
            return self.index.search(matrix, k, params=search_params(self.index, params))
        assert matched is not None
        ids = self._ids[matched]
        if plan.kind == "exact":  # the matching rows' stored vectors (decoded, as the base's are)
            if self._packed:  # FAISS's reconstruct of loaded fast-scan lists crashes (query.filter_plan)
                raise BadArgument("a fast-scan delta has no exact filter plan")
            return self._exact(matrix, k, self._ivf.reconstruct_batch(ids), ids)
        sel = faiss.IDSelectorBatch(ids)  # alive until FAISS returns: a local
        if plan.kind == "routed":
            assert query.assign is not None and query.coarse is not None
            return self._preassigned(matrix, query.assign[:, :plan.probe], query.coarse[:, :plan.probe],
                                     k, sel)
        return self.index.search(matrix, k, params=search_params(self.index, params, sel))

    def _search_flat(self, matrix: np.ndarray, k: int, plan: FilterPlan | None, matched: np.ndarray | None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """An exact flat delta (no probes, no graph): its index's rows are the arrays' rows, searched
        with the dead ones left out, or only the `matched` ones."""
        sel: faiss.IDSelector | None = None  # none dead: FAISS's plain scan
        if plan is None:
            if self._used > self.rows:
                sel = self._live.selector
        else:
            assert matched is not None
            if plan.kind == "exact":  # the matching rows' vectors, compared one by one
                return self._exact(matrix, k, self._vectors[matched], self._ids[matched])
            sel = faiss.IDSelectorBatch(matched)  # alive until FAISS returns: a local
        params = None if sel is None else faiss.SearchParameters(sel=sel)
        distances, rows = self.index.search(matrix, k, params=params)
        return distances, np.where(rows >= 0, self._ids[np.maximum(rows, 0)], -1)

    def _exact(self, matrix: np.ndarray, k: int, vectors: np.ndarray, ids: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
        """Brute force over these points."""
        flat = faiss.IndexFlat(self.dim, self.index.metric_type)
        flat.add(vectors)
        distances, rows = flat.search(matrix, min(k, len(ids)))
        return self._padded(distances, np.where(rows >= 0, ids[np.maximum(rows, 0)], -1), k)

    def _preassigned(self, matrix: np.ndarray, assign: np.ndarray, coarse: np.ndarray, k: int,
                     sel: faiss.IDSelector | None) -> tuple[np.ndarray, np.ndarray]:
        """The router's lists, scanned in the delta's IVF (the base's quantizer and codes)."""
        n, nprobe = assign.shape
        assign = np.ascontiguousarray(assign, np.int64)
        coarse = np.ascontiguousarray(coarse, np.float32)
        params = faiss.SearchParametersIVF(nprobe=nprobe, sel=sel)
        distances, ids = np.empty((n, k), np.float32), np.empty((n, k), np.int64)
        self._ivf.search_preassigned_c(n, faiss.swig_ptr(matrix), k, faiss.swig_ptr(assign),  # type: ignore[attr-defined]
                                      faiss.swig_ptr(coarse), faiss.swig_ptr(distances), faiss.swig_ptr(ids),
                                      False, params)
        return distances, ids

    def _worst(self) -> float:
        return -np.inf if self.metric != "l2" else np.inf

    def _missing(self, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full((n, k), self._worst(), np.float32), np.full((n, k), -1, np.int64)

    def _padded(self, distances: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if ids.shape[1] < k:  # fewer candidates than k: padded as FAISS pads
            pad = k - ids.shape[1]
            ids = np.hstack([ids, np.full((len(ids), pad), -1, np.int64)])
            distances = np.hstack([distances, np.full((len(ids), pad), self._worst(), np.float32)])
        return distances, ids

