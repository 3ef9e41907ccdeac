"""A shard with its delta: answers a ShardQuery as ShardSearcher.answer / answer_filtered do, over
the base index minus its tombstones plus the delta's live points, at one log position.

How a batch is answered: under the delta's lock, take the tombstones' snapshot (an immutable FAISS
selector) and search the delta (small: it takes little time under the lock); then, without the
lock, search the base with that snapshot left out; merge the two with the project's one
`merge_topk`, ties in FAISS's own order (one index's pieces). The base is immutable and the snapshot
is the delta's position, so the answer is the state at that one position: an id is answered at
most once (its base copy is hidden exactly when its delta copy exists or it was deleted).

IVF keeps the router's preassigned lists on both sides; the delta's IVF shares the base's quantizer
and codes, so sharded answers stay those of one unsharded index that applied the same writes.
Under a filter the plan (exact / routed lists / own search) is the base's rule on the shard's live
rows (base minus tombstones plus delta), and the delta is searched the same way, its own latest
metadata deciding which of its points match.

Caches: the searcher's per-filter caches (matching ids, selectors, gathered vectors) describe the
base's rows, which never change, so they stay keyed by filter alone; what changes with writes is
the delta's: the tombstones' snapshot per log position, and its filters' matching rows, bounded by
bytes and brought up to date by the rows written since (shardserve.writes.delta).
"""

from __future__ import annotations

import time

import numpy as np

from shardserve.query.merge import merge_topk
from shardserve.query.searcher import ShardSearcher
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.delta import ShardDelta


def base_points(searcher: ShardSearcher, ids: list[int], slots: list[int], columns: list[str],
                found: list[dict | None], matrix: np.ndarray | None) -> None:
    """Fill in `found` (each `columns`' value, {} without metadata) and `matrix` (when given) at
    `slots`, whose ids the base holds live, from the base's metadata and stored vectors."""
    if not slots:
        return
    wanted = [ids[s] for s in slots]
    rows = (searcher.metadata.lookup(wanted, columns) if searcher.metadata is not None and columns
            else [{} for _ in slots])
    for slot, row in zip(slots, rows, strict=True):
        found[slot] = row if row is not None else {c: None for c in columns}
    if matrix is not None:
        matrix[slots] = searcher.stored_vectors(np.array(wanted, np.int64))


class ShardWithDelta:
    def __init__(self, searcher: ShardSearcher, delta: ShardDelta):
        self.searcher, self.delta = searcher, delta
        self._ip = searcher.metric != "l2"

    @property
    def position(self) -> int:
        return self.delta.position

    def answer(self, query: ShardQuery) -> tuple[np.ndarray, np.ndarray, float, int, int]:
        """(distances, ids, ms, rows a filter matched (0 without one), the log position the answer
        is the state at: the delta's when its part and the tombstones' snapshot were taken)."""
        if "filter" in query.params:
            return self.answer_filtered(query)
        start = time.perf_counter()
        with self.delta.lock:
            exclude = self.delta.tombstones.exclusion()
            delta_d, delta_i = self.delta.search(query)
            position = self.delta.position
        base_d, base_i, _ = self.searcher.answer(query, exclude)
        distances, ids = merge_topk([base_d, delta_d], [base_i, delta_i], query.k, self._ip, ties_by_id=True)
        return distances, ids, (time.perf_counter() - start) * 1000.0, 0, position

    def answer_filtered(self, query: ShardQuery) -> tuple[np.ndarray, np.ndarray, float, int, int]:
        params = dict(query.params)
        where = params.pop("filter")
        start = time.perf_counter()
        selected = self.searcher.selected(where)  # the base's matching rows: cached by filter
        with self.delta.lock:
            exclude = self.delta.tombstones.exclusion()
            hidden = 0 if exclude is None else int(np.isin(selected, exclude.ids, assume_unique=True).sum())
            base_matched = len(selected) - hidden
            delta_matched = self.delta.matching_rows(where)
            matched = base_matched + len(delta_matched)
            position = self.delta.position
            rows = int(self.searcher.index.ntotal) - len(self.delta.tombstones) + self.delta.rows
            if not matched:
                worst = -np.inf if self._ip else np.inf
                n, k = len(query.matrix), query.k
                return (np.full((n, k), worst, np.float32), np.full((n, k), -1, np.int64),
                        (time.perf_counter() - start) * 1000.0, 0, position)
            plan = self.searcher.filter_plan(query, params, matched / max(rows, 1))
            delta_d, delta_i = self.delta.search(query, plan, delta_matched)
        parts_d, parts_i = [delta_d], [delta_i]
        if base_matched:
            base_d, base_i = self.searcher.search_by_plan(query, where, selected, plan, exclude)
            parts_d.insert(0, base_d)
            parts_i.insert(0, base_i)
        distances, ids = merge_topk(parts_d, parts_i, query.k, self._ip, ties_by_id=True)
        return distances, ids, (time.perf_counter() - start) * 1000.0, matched, position

    def ids_matching(self, where: str) -> tuple[np.ndarray, int]:
        """(the live ids that pass a checked filter, by their latest metadata, the log position
        that state is at): the base's matching ids not deleted or replaced since, plus the delta's
        matching points."""
        selected = self.searcher.selected(where)
        with self.delta.lock:
            exclude = self.delta.tombstones.exclusion()
            if exclude is not None:
                selected = selected[~np.isin(selected, exclude.ids)]
            return np.union1d(selected, self.delta.matching(where)), self.delta.position

    def live_ids(self, where: str | None = None) -> tuple[np.ndarray, int]:
        """(every live id, passing a checked filter `where` when given, ascending and distinct; the
        log position that state is at)."""
        if where is not None:
            return self.ids_matching(where)
        with self.delta.lock:
            exclude = self.delta.tombstones.exclusion()
            written = self.delta.live_ids()
            position = self.delta.position
        base = self.delta.tombstones.base_ids  # sorted, never changed
        if exclude is not None:
            base = base[~np.isin(base, exclude.ids)]
        return np.union1d(base, written), position

    def page(self, after: int | None, limit: int) -> np.ndarray:
        """The first `limit` live ids past `after`, ascending: the base's sorted ids read from the
        cursor on, a chunk at a time, less the hidden ones, merged with the delta's (no pass over
        the whole base: a scroll page costs its own size, plus a sort of the delta's ids)."""
        with self.delta.lock:
            exclude = self.delta.tombstones.exclusion()
            written = np.sort(self.delta.live_ids())
        base = self.delta.tombstones.base_ids  # sorted, never changed
        start = 0 if after is None else int(np.searchsorted(base, after, "right"))
        if after is not None:
            written = written[np.searchsorted(written, after, "right"):]
        taken: list[np.ndarray] = []
        held, chunk = 0, max(2 * limit, 1024)
        while held < limit and start < len(base):
            part = base[start:start + chunk]
            start += len(part)
            if exclude is not None:
                part = part[~np.isin(part, exclude.ids)]
            taken.append(part)
            held += len(part)
        ids = np.concatenate(taken) if taken else np.zeros(0, np.int64)
        if held >= limit:  # past the base's last id taken, only what no base id precedes
            written = written[written <= ids[limit - 1]]
        return np.union1d(ids, written)[:limit]

    def points(self, ids: list[int], columns: list[str],
               vectors: bool) -> tuple[list[dict | None], np.ndarray | None, int]:
        """Per id, its latest `columns` when this shard holds it live (None: not here, or deleted),
        the vectors of all `ids` when asked (the absent ones' rows zeros), and the log position
        that state is at."""
        found: list[dict | None] = [None] * len(ids)
        matrix = np.zeros((len(ids), self.searcher.dim), np.float32) if vectors else None
        base_slots = []
        with self.delta.lock:
            for slot, id_ in enumerate(ids):
                point = self.delta.point(id_)
                if point is not None:
                    meta = point[1]
                    found[slot] = {c: None if meta is None else meta.get(c) for c in columns}
                    if matrix is not None:
                        matrix[slot] = point[0]
                elif id_ not in self.delta.tombstones:
                    base_slots.append(slot)
            position = self.delta.position
        held = self.delta.tombstones.in_base(np.array([ids[s] for s in base_slots], np.int64))
        base_points(self.searcher, ids, [s for s, here in zip(base_slots, held, strict=True) if here],
                    columns, found, matrix)
        return found, matrix, position

    def lookup(self, ids: list[int], columns: list[str]) -> list[dict | None]:
        """Per id, its latest `columns` (None: not in this shard, or deleted): the delta's for its
        points, the base's for the others still live."""
        answers: list[dict | None] = [None] * len(ids)
        base_slots = []
        with self.delta.lock:
            for slot, id_ in enumerate(ids):
                here, meta = self.delta.metadata_of(id_)
                if here:
                    answers[slot] = {c: None if meta is None else meta.get(c) for c in columns}
                elif id_ not in self.delta.tombstones:
                    base_slots.append(slot)
        if base_slots and self.searcher.metadata is not None:
            found = self.searcher.metadata.lookup([ids[s] for s in base_slots], columns)
            for slot, row in zip(base_slots, found, strict=True):
                answers[slot] = row
        return answers
