"""A shard's tombstones: the ids of its immutable base index that writes deleted, replaced or moved
away, and the FAISS selector that leaves them out of a base search, one snapshot per log position.

Why snapshots: a search runs while writes keep arriving, and must see one log position throughout
(an overwrite seen in the delta but not yet hidden in the base would answer an id twice). A
snapshot is immutable and holds the buffers its selector reads (FAISS selectors do not own them),
so a search keeps it alive until FAISS returns, whatever is applied meanwhile.

Tombstones only grow until compaction folds them into a new base: each snapshot starts from the
previous one. Over an IndexIDMap2 (Flat, HNSW, refined IVF) the selector is a bitmap of the inner
rows still live (a copy of the last bitmap, the new rows cleared: n/8 bytes); over IVF, whose lists
hold the ids, it is "not in these sets" (IDSelectorNot over the settled tombstones' hash set or the
recent ones': a snapshot builds the recent set only).

The delta's own rows have tombstones too (`LiveRows`): a point overwritten or deleted in a flat
delta is a bit cleared, not FAISS's remove_ids, which on an IndexIDMap2 moves every row after it and
rebuilds the id map (work in the delta's size, on every replica, under the lock searches take).
"""

from __future__ import annotations

import faiss
import numpy as np

from shardserve.query.searcher import Exclusion

SETTLED_MIN = 1024  # below this many recent tombstones the settled set is not rebuilt


def stored_ids(index: faiss.Index) -> np.ndarray:
    """Every id a shard's index holds, in its own order (an IndexIDMap2: its inner rows')."""
    if isinstance(index, faiss.IndexIDMap):
        return faiss.vector_to_array(index.id_map).astype(np.int64)  # type: ignore[attr-defined]
    ivf = faiss.extract_index_ivf(index)
    lists = ivf.invlists
    parts = [faiss.rev_swig_ptr(lists.get_ids(number), lists.list_size(number)).copy()  # type: ignore[union-attr]
             for number in range(ivf.nlist) if lists.list_size(number)]  # type: ignore[union-attr]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def members(ordered: np.ndarray, ids: np.ndarray | list[int]) -> np.ndarray:
    """Which of `ids` are in `ordered` (ascending), by binary search."""
    ids = np.asarray(ids, np.int64)
    if not len(ordered):
        return np.zeros(len(ids), bool)
    return ordered[np.minimum(np.searchsorted(ordered, ids), len(ordered) - 1)] == ids


class Tombstones:
    """The base ids hidden so far (`hide`), and `exclusion()`, the snapshot to search with."""

    def __init__(self, base: faiss.Index):
        self._base = base  # the selector's rows are this index's
        ids = stored_ids(base)
        self._by_row = isinstance(base, faiss.IndexIDMap)
        self._order = np.argsort(ids, kind="stable")
        self.base_ids = ids[self._order]  # sorted: membership by binary search
        self.base_rows = len(ids)
        self._hidden: set[int] = set()
        self._pending: list[int] = []
        self._snapshot: Exclusion | None = None
        self._settled: tuple[faiss.IDSelector, np.ndarray] | None = None  # IVF: see _not_in

    def __len__(self) -> int:
        return len(self._hidden)

    def __contains__(self, id_: int) -> bool:
        return id_ in self._hidden

    def in_base(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` the base index holds."""
        return members(self.base_ids, ids)

    def hide(self, id_: int) -> bool:
        """Leave a base id out of every search from now on (False: not in the base, or hidden)."""
        if id_ in self._hidden:
            return False
        at = int(self.base_ids.searchsorted(id_))  # in_base for one id, without building arrays
        if at == len(self.base_ids) or self.base_ids[at] != id_:
            return False
        self._hidden.add(id_)
        self._pending.append(id_)
        return True

    def exclusion(self) -> Exclusion | None:
        """The current snapshot (None: nothing hidden, the base is searched as built)."""
        if self._pending:
            new = np.array(self._pending, np.int64)  # distinct: hide() takes each id once
            self._pending = []
            before = self._snapshot
            ids = new if before is None else np.concatenate([before.ids, new])
            if self._by_row:
                bits = (np.full((self.base_rows + 7) // 8, 0xFF, np.uint8) if before is None
                        else before.held[0].copy())
                rows = self._order[np.searchsorted(self.base_ids, new)]
                np.bitwise_and.at(bits, rows >> 3, ~(np.uint8(1) << (rows & 7).astype(np.uint8)))
                selector: faiss.IDSelector = faiss.IDSelectorBitmap(self.base_rows, faiss.swig_ptr(bits))
                self._snapshot = Exclusion(ids, selector, (bits,))
            else:
                self._snapshot = self._not_in(ids)
        return self._snapshot

    def _not_in(self, ids: np.ndarray) -> Exclusion:
        """"Not one of `ids`" over IVF ids, in two hash sets: the settled ones, built again only once
        the recent ones pass a quarter of them (building it costs time linear in the ids), and the
        recent ones, built per snapshot: a write costs a search the recent set, not every tombstone."""
        if self._settled is None or len(ids) - len(self._settled[1]) > max(SETTLED_MIN, len(ids) // 4):
            self._settled = (faiss.IDSelectorBatch(ids), ids)
        settled, settled_ids = self._settled
        if len(ids) == len(settled_ids):
            either: faiss.IDSelector = settled
            held: tuple = (settled, settled_ids)
        else:
            recent = faiss.IDSelectorBatch(ids[len(settled_ids):])
            either = faiss.IDSelectorOr(settled, recent)
            held = (settled, recent, either, settled_ids)
        selector = faiss.IDSelectorNot(either)
        selector.referenced_objects = list(held)  # type: ignore[attr-defined]
        return Exclusion(ids, selector, held)


class LiveRows:
    """Which of a delta's rows hold a live point (`mask`), and `selector`, the bitmap of them over the
    delta's flat index (its rows are the delta's rows). Changed in place, one bit a write: the delta
    searches under the lock its writes take, so no search sees it change. A new one at each repack."""

    def __init__(self, capacity: int, live: int = 0):
        self.mask = np.zeros(capacity, bool)
        self.mask[:live] = True
        self._bits = np.packbits(self.mask, bitorder="little")
        self.selector = faiss.IDSelectorBitmap(capacity, faiss.swig_ptr(self._bits))  # reads _bits

    def set(self, row: int, live: bool) -> None:
        self.mask[row] = live
        if live:
            self._bits[row >> 3] |= np.uint8(1 << (row & 7))
        else:
            self._bits[row >> 3] &= np.uint8(~(1 << (row & 7)) & 0xFF)
