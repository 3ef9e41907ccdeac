"""Removing points from a shard index of any kind the build makes: what compaction does to each shard
before it adds the upserts, and the test of which kinds take writes at all (`writes_refused`).

Why not FAISS's `remove_ids` alone: an IndexIDMap2 (every kind but plain IVF) removes from its inner
index and then assumes the inner one renumbered the rest 0..n-1 in order. A flat-codes index does; an
IVF inside a refine step or a pre-transform keeps its old numbers (the id map then points at the wrong
points), and HNSW graphs and refine steps have no `remove_ids` at all. So each kind is walked here and
its points are renumbered consistently:
- flat codes (Flat, PQ, SQ, ...): FAISS's `remove_ids` (it compacts in order);
- IVF lists: each list rewritten from its kept entries into a fresh buffer. Not FAISS's `remove_ids`:
  on fast-scan lists it leaves the removed codes' nibbles in the last block, and the next add ORs its
  codes into them (FAISS 1.15: points folded in after a delete came out with other codes; tested);
- HNSW: the graph rebuilt over the kept points, their stored codes kept as they were;
- a refine step (`...,RFlat`, `...,Refine(SQ8)`) or a pre-transform: both parts, the same positions.
A kind not listed (a refine that stores codes by id, NSG, fast-scan flat codes, an id map inside
another) is refused, with its name: the router refuses writes to it up front (`writes_refused`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import faiss
import numpy as np

from shardserve.errors import ShardserveError
from shardserve.index.indexes import make_empty_index

# Removes the given ids from a shard, or positions (sorted) from the inside of an id map, the rest
# renumbered 0..n-1 in order.
Removal = Callable[[np.ndarray], None]
# Why the kinds met so far cannot be rewritten; any other kind not handled below is refused as well.
_WHY = {"IndexIVFPQR": "keeps its refine codes by id, outside its lists",
        "IndexIVFFlatDedup": "shares one code between the ids of duplicate vectors",
        "IndexPQFastScan": "packs its codes in blocks that FAISS leaves dirty after a removal",
        "IndexNSGFlat": "builds its graph in one add and takes no points after it",
        "IndexIDMap2": "is an id map inside another one",
        "IndexIDMap": "is an id map inside another one"}


def remove_ids(index: faiss.Index, ids: np.ndarray) -> int:
    """Remove every point of `index` (a shard as the build makes it: an IndexIVF holding the ids, or an
    IndexIDMap(2) over an index numbering its points 0..n-1) whose id is in `ids`; return how many.
    An IVF's direct map is dropped (a loaded shard builds its own). ShardserveError naming the kind
    when the index is of a kind compaction cannot rewrite (`removal_refused`), before any change."""
    plan = _plan_shard(index)
    if isinstance(plan, str):
        raise ShardserveError(f"compaction cannot remove points from this index: {plan}")
    before = int(index.ntotal)
    plan(np.unique(np.asarray(ids, np.int64)))
    return before - int(index.ntotal)


def removal_refused(index: faiss.Index) -> str | None:
    """Why points cannot be removed from `index` (naming its kind), or None when they can."""
    plan = _plan_shard(index)
    return plan if isinstance(plan, str) else None


@lru_cache(maxsize=64)
def writes_refused(factory: str, dim: int, metric: str) -> str | None:
    """The refusal of a write to an index built from `factory` (an HTTP 501's message), or None when
    compaction can fold writes into it: an index kind that cannot be compacted never takes a write
    it would then hold in memory for good."""
    index = make_empty_index(factory, dim, metric)  # untrained: the same kinds as its shards
    reason = removal_refused(index)
    if reason is None:
        return None
    return (f"index {factory!r} takes no writes: compaction cannot remove points from it ({reason}); "
            "rebuild it with another --index to take writes")


def _plan_shard(index: faiss.Index) -> Removal | str:
    """How to remove user ids from a shard, or why it cannot be done."""
    if isinstance(index, faiss.IndexIDMap):  # IndexIDMap2 too
        inner = _plan(faiss.downcast_index(index.index))
        if isinstance(inner, str):
            return inner
        return lambda ids: _remove_mapped(index, inner, ids)
    top = faiss.downcast_index(index)
    if isinstance(top, faiss.IndexIVF):  # it holds the ids themselves
        return _plan_lists(top, renumber=False)
    return _refused(type(top).__name__, "has no id map")


def _plan(index: faiss.Index) -> Removal | str:
    """How to remove positions from an index that numbers its points 0..n-1 (the inside of an id
    map), keeping the others in order, or why it cannot be done. The closures hold `index`, whose
    owner (the shard) the caller keeps alive."""
    kind = type(index).__name__
    if isinstance(index, faiss.IndexIVF):
        return _plan_lists(index, renumber=True)
    if isinstance(index, faiss.IndexRefine):
        base = _plan(faiss.downcast_index(index.base_index))
        refine = _plan(faiss.downcast_index(index.refine_index))
        if isinstance(base, str) or isinstance(refine, str):
            return f"{base if isinstance(base, str) else refine}, inside its {kind}"

        def both(gone: np.ndarray) -> None:
            base(gone)
            refine(gone)
            index.ntotal -= len(gone)
        return both
    if isinstance(index, faiss.IndexPreTransform):
        inner = _plan(faiss.downcast_index(index.index))
        if isinstance(inner, str):
            return inner

        def transformed(gone: np.ndarray) -> None:
            inner(gone)
            index.ntotal -= len(gone)
        return transformed
    if isinstance(index, faiss.IndexHNSW):
        storage = faiss.downcast_index(index.storage)
        if not isinstance(storage, faiss.IndexFlatCodes):
            return _refused(kind, f"stores its points in an {type(storage).__name__}")
        return lambda gone: _rebuild_graph(index, storage, gone)
    if isinstance(index, faiss.IndexFlatCodes) and kind != "IndexFlat1D":  # Flat1D keeps a permutation
        return lambda gone: _remove_codes(index, gone)
    return _refused(kind, "is not a kind compaction can rewrite")


def _refused(kind: str, otherwise: str) -> str:
    return f"{kind} {_WHY.get(kind, otherwise)}"


def _plan_lists(ivf: faiss.IndexIVF, renumber: bool) -> Removal | str:
    kind = type(ivf).__name__
    if kind in _WHY:
        return _refused(kind, "")
    lists = _lists(ivf)
    if not isinstance(lists, faiss.ArrayInvertedLists | faiss.BlockInvertedLists):  # type: ignore[attr-defined]
        return _refused(kind, f"keeps its lists in an {type(lists).__name__}")
    return lambda gone: _rewrite_lists(ivf, gone, renumber)


def _lists(ivf: faiss.IndexIVF) -> faiss.InvertedLists:
    assert ivf.invlists is not None
    return faiss.downcast_InvertedLists(ivf.invlists)


def _remove_mapped(index: faiss.IndexIDMap, inner: Removal, ids: np.ndarray) -> None:
    """The positions of `ids` out of the inner index, then out of the id map (its rev map rebuilt)."""
    id_map = faiss.vector_to_array(index.id_map)  # type: ignore[attr-defined]
    gone = np.flatnonzero(np.isin(id_map, ids))
    if len(gone):
        inner(gone)
        kept = np.delete(id_map, gone)
        faiss.copy_array_to_vector(kept, index.id_map)  # type: ignore[attr-defined]
        index.ntotal = len(kept)
        if isinstance(index, faiss.IndexIDMap2):
            index.construct_rev_map()
        assert faiss.downcast_index(index.index).ntotal == len(kept), "inner index and id map disagree"


def _rewrite_lists(ivf: faiss.IndexIVF, drop: np.ndarray, renumber: bool) -> None:
    """Drop the entries whose id is in `drop` (sorted) from `ivf`'s lists, each list that changes
    rewritten from its kept entries in order into a zeroed buffer. `renumber`: the ids are positions,
    and each kept one moves down by the number dropped below it."""
    if ivf.direct_map.type != faiss.DirectMap.NoMap:  # type: ignore[attr-defined]
        ivf.set_direct_map_type(faiss.DirectMap.NoMap)  # type: ignore[attr-defined]
    lists = _lists(ivf)
    packer = lists.packer if isinstance(lists, faiss.BlockInvertedLists) else None  # type: ignore[attr-defined]
    code_size = packer.code_size if packer is not None else lists.code_size
    removed = 0
    for number in range(ivf.nlist):
        size = lists.list_size(number)
        if not size:
            continue
        ids = faiss.rev_swig_ptr(lists.get_ids(number), size).copy()
        keep = ~np.isin(ids, drop)
        kept = ids[keep] - np.searchsorted(drop, ids[keep]) if renumber else ids[keep]
        if len(kept) == size and np.array_equal(kept, ids):
            continue  # nothing dropped, nothing renumbered
        codes = _unpacked(lists, packer, number, size, code_size)[keep]
        lists.resize(number, 0)
        if len(kept):
            stored = codes if packer is None else _packed(packer, codes)
            lists.add_entries(number, len(kept), faiss.swig_ptr(np.ascontiguousarray(kept, np.int64)),
                              faiss.swig_ptr(stored))
        removed += size - len(kept)
    ivf.ntotal -= removed


def _unpacked(lists: faiss.InvertedLists, packer: faiss.CodePacker | None, number: int, size: int,
              code_size: int) -> np.ndarray:
    """One list's codes, one row an entry."""
    if packer is None:
        return faiss.rev_swig_ptr(lists.get_codes(number), size * code_size).reshape(size, code_size).copy()
    blocks = -(-size // packer.nvec)
    packed = faiss.rev_swig_ptr(lists.get_codes(number), blocks * packer.block_size).copy()
    flat = np.zeros((blocks * packer.nvec, code_size), np.uint8)
    for block in range(blocks):
        packer.unpack_all(faiss.swig_ptr(packed[block * packer.block_size:]),
                          faiss.swig_ptr(flat[block * packer.nvec:]))
    return flat[:size]


def _packed(packer: faiss.CodePacker, codes: np.ndarray) -> np.ndarray:
    """`codes` in fast-scan blocks, the last one's unused slots zero (what an add packs into)."""
    blocks = -(-len(codes) // packer.nvec)
    flat = np.zeros((blocks * packer.nvec, codes.shape[1]), np.uint8)
    flat[:len(codes)] = codes
    packed = np.zeros(blocks * packer.block_size, np.uint8)
    for block in range(blocks):
        packer.pack_all(faiss.swig_ptr(flat[block * packer.nvec:]),
                        faiss.swig_ptr(packed[block * packer.block_size:]))
    return packed


def _remove_codes(index: faiss.IndexFlatCodes, gone: np.ndarray) -> None:
    removed = index.remove_ids(faiss.IDSelectorBatch(gone))
    assert removed == len(gone), f"{type(index).__name__} removed {removed} of {len(gone)} positions"


def _rebuild_graph(index: faiss.IndexHNSW, storage: faiss.IndexFlatCodes, gone: np.ndarray) -> None:
    """HNSW cannot unlink a point: the graph is built again over the kept points (their decoded
    vectors), and their stored codes are put back as they were (a decode and re-encode of SQ or PQ
    codes could move a point)."""
    keep = np.delete(np.arange(index.ntotal), gone)
    codes = faiss.vector_to_array(storage.codes).reshape(index.ntotal, storage.code_size)[keep]  # type: ignore[attr-defined]
    vectors = storage.reconstruct_n(0, index.ntotal)[keep]
    index.reset()
    if len(keep):
        index.add(vectors)
    faiss.copy_array_to_vector(codes.ravel(), storage.codes)  # type: ignore[attr-defined]
