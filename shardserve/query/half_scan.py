"""An IVF-Flat shard's scan at half the memory reads, with FAISS's own answers.

Where a shard's lists are larger than a core's cache, its scan is bound by reading them: 4 bytes a
dimension, every probed vector. The shard keeps a half-precision copy of its lists (FAISS's
IndexIVFScalarQuantizer, QT_fp16, the same lists in the same order, the same ids) and scans that,
which reads half the bytes. It keeps `KEPT_FACTOR` x k candidates a query, then computes their
distances again from the float32 vectors, with the kernel FAISS's IVF-Flat scan uses
(fvec_L2sqr / fvec_inner_product: the same bytes as FAISS's own answer).

Why the answer is FAISS's, not an approximation: the copy's error is bounded, e = max ||x - x'||
over the shard's vectors (x' the half-precision vector, measured when the copy is made). A vector
that is not a candidate is at least as far, in the copy, as the last candidate kept (a query's
scan drops a vector only behind KEPT_FACTOR x k at least as close). So its true distance is at
least sqrt(last) - e (L2), or its true score at most last + |q| e (inner product). Where that
bound is strictly worse than the k-th exact distance among the candidates, no vector left out can
enter the top k, and the candidates sorted FAISS's way (distance, then id) are FAISS's answer. A
row where the bound does not settle it (`again`), or where the (k+1)-th candidate ties the k-th (FAISS
then keeps whichever it scanned first), is searched again by FAISS on the float32 lists.

Measured at 4M x 128 (lists of ~3,900 vectors, 2 MB in float32), in-process, each of 4 shards: a
query cost 0.63-0.81x the CPU of the float32 scan at batches of 1, 32 and 128, every row was
settled by the bound, and every answer equalled FAISS's, distances bit for bit (lab.half_scan,
half-scan-4m.json). Its cost: the copy, 2 bytes a dimension a row in
each replica's memory, made as the replica loads (about 1.5 s a million rows of 128), and a
hash map from id to place in the lists (FAISS's direct map), to read the candidates' vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from shardserve.query.merge import merge_topk

KEPT_FACTOR = 2  # candidates a query keeps from the half-precision scan, per answer asked
_FP16_MAX = 65504.0  # beyond it a value would be infinite in half precision: no copy is made
_ROUNDING = 1e-4  # relative slack for float32 rounding in both distances (128 terms: < 1e-5)
_MISSING = {False: np.finfo(np.float32).max, True: -np.finfo(np.float32).max}


@dataclass(frozen=True)
class HalfCopy:
    """A half-precision copy of an IVF-Flat index's lists, its bound, and the float32 index."""

    index: faiss.IndexIVFScalarQuantizer
    flat: faiss.IndexIVFFlat
    error: float  # max ||x - x'|| over the copy's vectors
    max_norm: float  # max ||x||: the inner product's rounding slack scales with it

    @classmethod
    def of(cls, flat: faiss.IndexIVFFlat) -> HalfCopy | None:
        """The copy, list by list (one list's vectors in memory at a time, besides the copy), or
        None where a value is beyond half precision's range or not finite."""
        d, lists = int(flat.d), flat.invlists
        assert lists is not None, "an IVF index without inverted lists"
        half = faiss.IndexIVFScalarQuantizer(flat.quantizer, d, int(flat.nlist),
                                             faiss.ScalarQuantizer.QT_fp16, flat.metric_type, False)
        half.is_trained = True  # QT_fp16 has nothing to train
        error = max_norm = 0.0
        for number in range(int(flat.nlist)):
            size = int(lists.list_size(number))
            if not size:
                continue
            codes32 = faiss.rev_swig_ptr(lists.get_codes(number), size * d * 4)
            vectors = codes32.view(np.float32).reshape(size, d)
            if not np.isfinite(vectors).all() or np.abs(vectors).max() >= _FP16_MAX:
                return None
            ids = faiss.rev_swig_ptr(lists.get_ids(number), size).view(np.int64).copy()
            codes = half.sq.compute_codes(vectors)
            exact = vectors.astype(np.float64)
            error = max(error, float(np.sqrt(((exact - half.sq.decode(codes)) ** 2).sum(axis=1)).max()))
            max_norm = max(max_norm, float(np.sqrt((exact ** 2).sum(axis=1)).max()))
            half.invlists.add_entries(number, size, faiss.swig_ptr(ids), faiss.swig_ptr(codes))  # type: ignore[union-attr]
        half.ntotal = flat.ntotal
        # the candidates' float32 vectors are read by id (the lists hold the user's ids)
        if flat.direct_map.type == faiss.DirectMap.NoMap:  # type: ignore[attr-defined]
            flat.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
        return cls(half, flat, error, max_norm)

    def rerank(self, matrix: np.ndarray, found_d: np.ndarray, found_i: np.ndarray, k: int,
               higher_is_better: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(distances, ids, rows to search again) from the half-precision scan's candidates
        (`found_d`/`found_i`, (n, kept) best first, as FAISS returns them)."""
        n, kept = found_i.shape
        d = int(self.flat.d)
        valid = found_i >= 0
        vectors = np.zeros((n * kept, d), np.float32)
        if valid.any():
            vectors[valid.ravel()] = self.flat.reconstruct_batch(found_i[valid])
        exact = np.empty((n, kept), np.float32)
        rows = np.arange(n * kept, dtype=np.int64)
        queries = np.ascontiguousarray(matrix, np.float32)
        # the kernels FAISS's IVF-Flat scanner calls, one (query, candidate) pair each
        kernel = faiss.fvec_inner_products_by_idx if higher_is_better else faiss.fvec_L2sqr_by_idx  # type: ignore[attr-defined]
        kernel(faiss.swig_ptr(exact), faiss.swig_ptr(queries), faiss.swig_ptr(vectors), faiss.swig_ptr(rows),
               d, n, kept)
        exact[~valid] = _MISSING[higher_is_better]
        top_d, top_i = merge_topk([exact], [found_i], k + 1, higher_is_better, ties_by_id=True)
        # fewer candidates than kept: the scan found no more, every vector probed is a candidate
        settled = ~valid[:, -1] | self._excludes_the_rest(queries, found_d[:, -1], top_d[:, k - 1],
                                                           higher_is_better)
        tie = (top_i[:, k] >= 0) & (top_d[:, k] == top_d[:, k - 1])
        return top_d[:, :k], top_i[:, :k], np.flatnonzero(~settled | tie)

    def _excludes_the_rest(self, queries: np.ndarray, last: np.ndarray, kth: np.ndarray,
                           higher_is_better: bool) -> np.ndarray:
        """Is every vector the scan left out strictly worse than the k-th exact candidate, as FAISS
        would compute both (a bound on the true distance, then on float32's rounding of it)?"""
        last64, kth64 = last.astype(np.float64), kth.astype(np.float64)
        if not higher_is_better:
            nearest_left_out = np.sqrt(np.maximum(last64, 0) * (1 - _ROUNDING)) - self.error * (1 + _ROUNDING)
            return nearest_left_out > np.sqrt(np.maximum(kth64, 0) * (1 + 2 * _ROUNDING))
        norms = np.sqrt((queries.astype(np.float64) ** 2).sum(axis=1))
        slack = _ROUNDING * norms * (self.max_norm + self.error)
        return last64 + norms * self.error + 2 * slack < kth64
