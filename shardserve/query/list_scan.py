"""A shard's scan of a large batch, list by list instead of query by query, with FAISS's answers.

FAISS scans an IVF batch query by query: each query reads its probed lists from memory, and with
256 queries a list is read again for every query that probes it. An IVF-Flat scan is bound by
those reads (one 784-float code per distance). Here every (query, list) pair of the batch becomes
one row of a single `search_preassigned` call with nprobe=1, rows grouped by list: a list is read
once and stays in cache while all its queries are scanned. Distances come from the same FAISS
scanner on the same pairs, so they are the same bytes; the per-query top-k is then merged.

Ties: FAISS keeps the k best in a heap that admits a candidate only when it beats the worst kept
one, and sorts its answer by distance, then id. Each pair keeps k+1; where the (k+1)-th best of a
query's pairs is worse than its k-th, the k best are one set whatever the scan order, and sorting
it FAISS's way gives FAISS's answer. Rows with a tie at the k-th distance are searched again
the FAISS way (FAISS's result then depends on its scan order).
"""

from __future__ import annotations

import faiss
import numpy as np

from shardserve.query.merge import merge_topk

# Worst-possible distances FAISS writes where a result is missing (id -1).
_MISSING = {False: np.finfo(np.float32).max, True: -np.finfo(np.float32).max}


def search_by_lists(ivf: faiss.IndexIVF, nonempty: np.ndarray, matrix: np.ndarray, assign: np.ndarray,
                    coarse: np.ndarray, k: int, higher_is_better: bool,
                    one_probe: faiss.SearchParametersIVF) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distances, ids, rows to search again the FAISS way) of a preassigned batch.

    `matrix` float32 (n, d); `assign`/`coarse` the router's (n, nprobe) lists and their coarse
    distances; `one_probe` SearchParametersIVF(nprobe=1)."""
    n = len(matrix)
    inside = nonempty[assign]                      # the probes whose lists this shard holds
    rows, probes = np.nonzero(inside)              # query by query, in probe order
    lists = assign[rows, probes]
    by_list = np.argsort(lists, kind="stable")
    pair_rows = rows[by_list]
    pairs = len(pair_rows)
    pair_matrix = np.ascontiguousarray(matrix[pair_rows])
    pair_lists = np.ascontiguousarray(lists[by_list][:, None], np.int64)
    pair_coarse = np.ascontiguousarray(coarse[rows, probes][by_list][:, None], np.float32)
    kept = k + 1  # one more than asked: shows whether a list had more at the k-th distance
    pair_d = np.empty((pairs, kept), np.float32)
    pair_i = np.empty((pairs, kept), np.int64)
    if pairs:
        ivf.search_preassigned_c(pairs, faiss.swig_ptr(pair_matrix), kept, faiss.swig_ptr(pair_lists),  # type: ignore[attr-defined]
                                 faiss.swig_ptr(pair_coarse), faiss.swig_ptr(pair_d),
                                 faiss.swig_ptr(pair_i), False, one_probe)
    # Each query's pairs side by side: slot = the probe's rank among the query's probes held here.
    slot = (np.cumsum(inside, axis=1) - 1)[rows, probes][by_list]
    width = max(int(inside.sum(axis=1).max(initial=0)), 1)
    pool_d = np.full((n, width, kept), _MISSING[higher_is_better], np.float32)
    pool_i = np.full((n, width, kept), -1, np.int64)
    pool_d[pair_rows, slot], pool_i[pair_rows, slot] = pair_d, pair_i
    top_d, top_i = merge_topk([pool_d.reshape(n, width * kept)], [pool_i.reshape(n, width * kept)], kept,
                              higher_is_better, ties_by_id=True)  # FAISS's order: best first, ties by id
    top_key = -top_d if higher_is_better else top_d
    # Ambiguous only where the (k+1)-th candidate ties the k-th. Otherwise nothing a list dropped
    # can reach the k-th distance: a list drops a candidate only behind k+1 at least as good, all
    # in the pool.
    again = (top_i[:, k] >= 0) & (top_key[:, k] == top_key[:, k - 1])
    return top_d[:, :k], top_i[:, :k], np.flatnonzero(again)
