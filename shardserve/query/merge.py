"""The one top-k merge of the project: router, eval and tests all call `merge_topk`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardserve.errors import BadArgument


def merge_topk(distances: list[np.ndarray], ids: list[np.ndarray], k: int,
               higher_is_better: bool, ties_by_id: bool = False,
               positions: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Merge per-shard (nq, k_i) results into the global (nq, k) best, vectorised.

    Missing results (FAISS pads with id -1) sort last. Ties keep shard order (stable sort), so the
    merge is deterministic; `ties_by_id` orders them as FAISS's own heaps do instead (id ascending
    for L2, descending for inner product: CMax/CMin::cmp2), for merging pieces of one index's scan
    (shardserve.query.list_scan). `higher_is_better` is True for inner product / cosine.

    `positions`: the write-log position each part answered at (the shards of one search). Parts at
    one position hold an id at most once between them; parts at different positions may both hold
    an id that an overwrite moved from one shard to another in between, so an id found in several
    parts keeps only its copy from the newest position, the others are dropped like padding.
    """
    if not distances:
        raise BadArgument("merge_topk needs at least one shard result")
    all_distances = np.concatenate(distances, axis=1)
    all_ids = np.concatenate(ids, axis=1)
    keys = -all_distances if higher_is_better else all_distances.copy()
    if positions is not None and len(set(positions)) > 1:
        columns = np.repeat(np.asarray(positions, np.int64), [part.shape[1] for part in ids])
        stale = _older_copies(all_ids, columns)
        if stale.any():
            all_ids = np.where(stale, -1, all_ids)
            all_distances = np.where(stale, -np.inf if higher_is_better else np.inf, all_distances)
    keys[all_ids < 0] = np.inf
    if ties_by_id:
        order = np.lexsort((-all_ids if higher_is_better else all_ids, keys), axis=1)[:, :k]
    else:
        order = np.argsort(keys, axis=1, kind="stable")[:, :k]
    top_ids = np.take_along_axis(all_ids, order, axis=1)
    top_distances = np.take_along_axis(all_distances, order, axis=1)
    if top_ids.shape[1] < k:  # fewer candidates than k in total: pad like FAISS does
        pad = k - top_ids.shape[1]
        fill = -np.inf if higher_is_better else np.inf
        top_ids = np.pad(top_ids, ((0, 0), (0, pad)), constant_values=-1)
        top_distances = np.pad(top_distances, ((0, 0), (0, pad)), constant_values=fill)
    return top_distances, top_ids


def _older_copies(ids: np.ndarray, column_positions: np.ndarray) -> np.ndarray:
    """(nq, m) True where a row's id appears again in a column of a newer log position (or, at one
    position, in an earlier column): the copies to leave out so that each id is answered once."""
    newest_first = np.broadcast_to(-column_positions, ids.shape)
    order = np.lexsort((newest_first, ids), axis=1)  # by id, then newest position first
    in_order = np.take_along_axis(ids, order, axis=1)
    again = (in_order[:, 1:] == in_order[:, :-1]) & (in_order[:, 1:] >= 0)
    stale = np.zeros(ids.shape, bool)
    np.put_along_axis(stale, order[:, 1:], again, axis=1)
    return stale


@dataclass
class QueryResult:
    """One query's merged answer, and how it was reached (coverage, timings, batch)."""

    distances: np.ndarray
    ids: np.ndarray
    answered: int
    shards: int
    compute_ms: float
    fanout_ms: float
    batch_size: int
    error: str | None = None  # the first shard failure when no shard answered
    matched: int = 0  # with a filter: the rows that match it, summed over the shards that answered
