"""A shard's delta tier: the writes applied on top of its immutable base index, in log order.

Why a delta and not FAISS's own add/remove: shard files are read-only maps (IO_FLAG_MMAP |
IO_FLAG_READ_ONLY), shared by every replica of the shard on a node; FAISS refuses add_with_ids and
remove_ids on them. So each replica keeps, in memory:
- the points upserted since the base was built whose home (shardserve.writes.route) is this shard,
  with their metadata, in a small FAISS index of the base's own kind: for plain IVF a copy of the
  trained empty index the shards were built from (same quantizer, same codes, so a delta point is
  found exactly when the unsharded index would find it, with the same distance); otherwise an
  exact flat index;
- tombstones: base ids deleted, overwritten or moved away (shardserve.writes.tombstones).

Every shard applies every request of the log, in order: a shard needs to know when a point it holds
(in its base or its delta) is deleted or overwritten anywhere. `apply` is idempotent for positions
already applied, so a replica replaying the log after a restart, or a retried delivery, is harmless.
A point lives in the delta at most once (an overwrite removes its previous row), so an id is
answered at most once, with its latest vector and metadata.

Memory is bounded by `max_rows` rows of vectors; past it `apply` refuses the request (DeltaFull),
whole, before changing anything: the router answers 503 + Retry-After until compaction makes room.
Tombstones are bounded by the base's rows (only base ids are tombstoned).
"""

from __future__ import annotations

import threading

import faiss
import numpy as np
import pyarrow as pa

from shardserve.index.indexes import index_from_bytes, search_params
from shardserve.query.filters import matching
from shardserve.query.searcher import FilterPlan, ShardSearcher
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.ops import Op, Upsert
from shardserve.writes.route import WriteRoute
from shardserve.writes.tombstones import Tombstones

MAX_DELTA_ROWS = 200_000  # per shard replica: 200,000 x 784 float32 is 627 MB of vectors (twice: codes)


class DeltaFull(Exception):
    """A request would put more rows in a shard's delta than its bound: nothing was applied."""

    def __init__(self, rows: int, adding: int, max_rows: int):
        super().__init__(f"the shard's delta holds {rows} rows, {adding} more would pass its bound of "
                         f"{max_rows}: retry once compaction has folded it into a new version")
        self.rows, self.adding, self.max_rows = rows, adding, max_rows


class ShardDelta:
    """One shard replica's delta over `base`. `trained`: the manifest's trained empty index (needed
    when the base is plain IVF). Safe across threads: `lock` guards everything; a search takes it
    for the delta's part and the tombstones' snapshot (shardserve.writes.shard)."""

    def __init__(self, base: ShardSearcher, shard: int, route: WriteRoute, trained: bytes | None = None,
                 max_rows: int = MAX_DELTA_ROWS):
        self.shard, self.route, self.max_rows = shard, route, max_rows
        self.dim, self.metric = base.dim, base.metric
        self.ivf_delta = base.ivf is not None and not isinstance(base.index, faiss.IndexIDMap)
        if self.ivf_delta:
            if trained is None:
                raise ValueError("an IVF shard's delta copies the trained empty index: pass `trained`")
            self.index = index_from_bytes(trained)
            self._ivf = faiss.extract_index_ivf(self.index)
            if self.index.ntotal or self._ivf.nlist != base.ivf.nlist:  # type: ignore[union-attr]
                raise ValueError("`trained` is not the empty index this shard was built from")
            self._ivf.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
        else:
            self.index = faiss.IndexIDMap2(faiss.IndexFlat(self.dim, base.index.metric_type))
        self.schema = None if base.metadata is None else base.metadata.table.schema
        self.tombstones = Tombstones(base.index)
        self.lock = threading.RLock()
        self._applied = threading.Condition(self.lock)
        self.position = 0  # the last log position applied
        self._slot: dict[int, int] = {}  # live id -> its row in the arrays below
        self._ids = np.zeros(0, np.int64)
        self._vectors = np.zeros((0, self.dim), np.float32)
        self._meta: list[dict | None] = []
        self._used = 0  # rows used, the dead ones (deleted, overwritten) until a repack
        self._table: tuple[pa.Table, np.ndarray] | None = None  # live metadata, at `position`
        self._matched: dict[str, np.ndarray] = {}  # filter -> live delta ids matching, at `position`

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
                    raise ValueError(f"request {position}: a vector of shape {point.vector.shape}, "
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
                self._grow(self.rows + adding)
            touched = {op.id for op in ops}
            was_here = [id_ for id_ in touched if id_ in self._slot]
            homes = iter(home)
            for op in ops:
                self._slot.pop(op.id, None)  # its previous row is dead (repacked later)
                self.tombstones.hide(op.id)  # a base copy is hidden for good
                if isinstance(op, Upsert) and next(homes) == self.shard:
                    self._ids[self._used], self._vectors[self._used] = op.id, op.vector
                    self._meta[self._used] = op.metadata
                    self._slot[op.id] = self._used
                    self._used += 1
            if was_here:
                gone = np.array(was_here, np.int64)  # the selector reads it: alive through the call
                self.index.remove_ids(faiss.IDSelectorArray(gone))
            now = np.array(sorted(self._slot[id_] for id_ in touched if id_ in self._slot), np.int64)
            if len(now):
                self.index.add_with_ids(self._vectors[now], self._ids[now])
            self.position = position
            self._table, self._matched = None, {}
            self._applied.notify_all()
            return True

    def wait_applied(self, position: int, timeout_s: float) -> bool:
        """Block until `position` is applied (a search that must see a write), or time out."""
        with self._applied:
            return self._applied.wait_for(lambda: self.position >= position, timeout_s)

    def _grow(self, live_needed: int) -> None:
        """Room for `live_needed` live rows: the dead rows dropped (a repack), capacity doubled."""
        live = np.array(sorted(self._slot.values()), np.int64)
        capacity = max(1024, 2 * live_needed)
        ids, vectors = np.zeros(capacity, np.int64), np.zeros((capacity, self.dim), np.float32)
        ids[:len(live)], vectors[:len(live)] = self._ids[live], self._vectors[live]
        meta: list[dict | None] = [self._meta[row] for row in live.tolist()] + [None] * (capacity - len(live))
        self._ids, self._vectors, self._meta = ids, vectors, meta
        self._slot = {int(id_): row for row, id_ in enumerate(ids[:len(live)].tolist())}
        self._used = len(live)

    def points(self) -> tuple[np.ndarray, np.ndarray, list[dict | None]]:
        """The live points (ids, vectors, metadata), as upserted: what compaction folds in."""
        with self.lock:
            rows = np.array(sorted(self._slot.values()), np.int64)
            return self._ids[rows].copy(), self._vectors[rows].copy(), [self._meta[r] for r in rows.tolist()]

    def metadata_of(self, id_: int) -> tuple[bool, dict | None]:
        """(is the id in the delta, its metadata)."""
        with self.lock:
            row = self._slot.get(id_)
            return (False, None) if row is None else (True, self._meta[row])

    def matching(self, where: str) -> np.ndarray:
        """The live delta ids whose (latest) metadata pass a checked filter; caller holds `lock`."""
        found = self._matched.get(where)
        if found is None:
            if self.schema is None:
                raise ValueError("this shard holds no metadata to filter on")
            if self._table is None:
                rows = np.array(sorted(self._slot.values()), np.int64)
                metas = [self._meta[r] for r in rows.tolist()]
                columns = {f.name: pa.array([None if m is None else m.get(f.name) for m in metas], f.type)
                           for f in self.schema}
                self._table = (pa.table(columns, schema=self.schema), self._ids[rows].copy())
            found = self._matched[where] = matching(where, self._table[0], self._table[1])
        return found

    def search(self, query: ShardQuery, plan: FilterPlan | None = None,
               matched: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The delta's top-k of a batch, unfiltered (`plan` None) or the way the shard's filter
        `plan` searches its base, among the `matched` delta ids; caller holds `lock`."""
        n, k = len(query.matrix), query.k
        matrix = np.ascontiguousarray(query.matrix, np.float32)
        if not self.rows or (plan is not None and (matched is None or not len(matched))):
            return self._missing(n, k)
        params = dict(query.params) if plan is None else dict(plan.params)
        params.pop("filter", None)
        if not self.ivf_delta:
            params = {}  # an exact flat delta: no probes, no graph
        if plan is None:
            if self.ivf_delta and query.assign is not None and query.coarse is not None:
                return self._preassigned(matrix, query.assign, query.coarse, k, None)
            return self.index.search(matrix, k, params=search_params(self.index, params))
        assert matched is not None
        if plan.kind == "exact":  # the matching rows' stored vectors, compared one by one
            flat = faiss.IndexFlat(self.dim, self.index.metric_type)
            flat.add(self._stored(matched))
            distances, rows = flat.search(matrix, min(k, len(matched)))
            return self._padded(distances, np.where(rows >= 0, matched[np.maximum(rows, 0)], -1), k)
        sel = faiss.IDSelectorBatch(matched)  # alive until FAISS returns: a local
        if plan.kind == "routed":
            assert query.assign is not None and query.coarse is not None
            return self._preassigned(matrix, query.assign[:, :plan.probe], query.coarse[:, :plan.probe],
                                     k, sel)
        return self.index.search(matrix, k, params=search_params(self.index, params, sel))

    def _stored(self, ids: np.ndarray) -> np.ndarray:
        """The vectors the delta's index stores for `ids` (decoded, as the base's are)."""
        if self.ivf_delta:
            return self._ivf.reconstruct_batch(ids)
        return self._vectors[np.array([self._slot[int(i)] for i in ids.tolist()], np.int64)]

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

