"""An IVF-Flat shard's scan at half the memory reads, with FAISS's own answers.

Where a shard's lists are larger than a core's cache, its scan is bound by reading them: 4 bytes a
dimension, every probed vector. The shard keeps a half-precision copy of its lists (FAISS's
IndexIVFScalarQuantizer, QT_fp16, the same lists in the same order, the same ids) and scans that,
which reads half the bytes. It keeps `KEPT_FACTOR` x k candidates a query, then computes their
distances again from the float32 vectors, with the kernel FAISS's IVF-Flat scan uses
(fvec_L2sqr / fvec_inner_product: the same bytes as FAISS's own answer).

Why the answer is FAISS's, not an approximation: the copy's error is bounded, e = max ||x - x'||
over the vectors of each list (x' the half-precision vector, measured list by list when the copy is
made); a query's bound takes the largest e of the lists it probes, so one point of huge components
(an upsert compacted in) loosens the bound of the queries that probe its list only, and a list
holding a value half precision cannot hold (beyond 65504) is marked unbounded: every query probing
it is FAISS's. A vector
that is not a candidate is at least as far, in the copy, as the last candidate kept (a query's
scan drops a vector only behind KEPT_FACTOR x k at least as close). So its true distance is at
least sqrt(last) - e (L2), or its true score at most last + |q| e (inner product). Where that
bound is strictly worse than the k-th exact distance among the candidates, no vector left out can
enter the top k, and the candidates sorted FAISS's way (distance, then id) are FAISS's answer. A
row where the bound does not settle it (`again`), or where the (k+1)-th candidate ties the k-th (FAISS
then keeps whichever it scanned first), is searched again by FAISS on the float32 lists.

What it saves, and how often the bound settles a row: docs/performance.md. Its cost: the copy, 2
bytes a dimension a row in each replica's memory, made as the replica loads (seconds a million rows,
on one thread, with the next item), and a hash map from id to place in the lists (FAISS's direct
map), to read the candidates' vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from shardserve.query.merge import merge_topk

KEPT_FACTOR = 2  # candidates a query keeps from the half-precision scan, per answer asked
_FP16_MAX = 65504.0  # beyond it a value would be infinite in half precision: no copy is made
# float32 rounding in both distances: relative, at least 1e-4 (FAISS's SIMD sums of 128 terms err
# far less), more with the dimension (a sequential sum's bound, d x 2^-24, four times over); and
# absolute where distances fall among float32's subnormals (2^-149 a step).
_ROUNDING = 1e-4
_SUBNORMAL = 2.0 ** -149
_MISSING = {False: np.finfo(np.float32).max, True: -np.finfo(np.float32).max}
RERANK_BYTES = 16 << 20  # the candidates' float32 vectors gathered at once, rows at a time
_ERROR_ROWS = 16384  # rows of a list measured at once against their copy (float64)
# The copy sits out while more than half of the recent rows it scanned went back to FAISS anyway
# (queries far from the data, or data the bound cannot separate: each such row costs the copy's
# scan on top of FAISS's), counted over about GATE_ROWS rows; every GATE_PROBE-th batch it is
# tried again, so the count follows the queries.
GATE_ROWS = 1024
GATE_PROBE = 16


class FallbackGate:
    """Whether a batch scans the copy first (see GATE_ROWS). Its counts are advisory: two threads
    updating them at once can lose an update, never an answer."""

    def __init__(self) -> None:
        self.rows = 0.0
        self.again = 0.0
        self.skipped = 0

    def use(self) -> bool:
        if self.again * 2 <= self.rows or self.skipped >= GATE_PROBE:
            self.skipped = 0
            return True
        self.skipped += 1
        return False

    def record(self, rows: int, again: int) -> None:
        self.rows += rows
        self.again += again
        if self.rows > GATE_ROWS:
            self.rows, self.again = self.rows / 2, self.again / 2


@dataclass(frozen=True)
class HalfCopy:
    """A half-precision copy of an IVF-Flat index's lists, its bound, and the float32 index."""

    index: faiss.IndexIVFScalarQuantizer
    flat: faiss.IndexIVFFlat
    error: float  # max ||x - x'|| over the vectors of the lists the copy holds exactly enough
    max_norm: float  # max ||x||: the inner product's rounding slack scales with it
    list_errors: np.ndarray | None = None  # per list: its max ||x - x'|| (inf: a value beyond fp16)
    list_norms: np.ndarray | None = None  # per list: its max ||x||

    @classmethod
    def of(cls, flat: faiss.IndexIVFFlat) -> HalfCopy | None:
        """The copy, list by list (one list's vectors in memory at a time, besides the copy); None
        where no list's values fit half precision's range."""
        d, lists = int(flat.d), flat.invlists
        assert lists is not None, "an IVF index without inverted lists"
        half = faiss.IndexIVFScalarQuantizer(flat.quantizer, d, int(flat.nlist),
                                             faiss.ScalarQuantizer.QT_fp16, flat.metric_type, False)
        half.is_trained = True  # QT_fp16 has nothing to train
        error = max_norm = 0.0
        list_errors = np.zeros(int(flat.nlist), np.float64)
        list_norms = np.zeros(int(flat.nlist), np.float64)
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)  # FAISS encodes in parallel: not on the cores replicas serve from
        try:
            for number in range(int(flat.nlist)):
                size = int(lists.list_size(number))
                if not size:
                    continue
                codes32 = faiss.rev_swig_ptr(lists.get_codes(number), size * d * 4)
                vectors = codes32.view(np.float32).reshape(size, d)
                ids = faiss.rev_swig_ptr(lists.get_ids(number), size).view(np.int64).copy()
                if not np.isfinite(vectors).all() or np.abs(vectors).max() >= _FP16_MAX:
                    # held clipped, so the lists stay aligned; never settled by the copy
                    list_errors[number] = list_norms[number] = np.inf
                    held = np.clip(np.nan_to_num(vectors), -_FP16_MAX / 2, _FP16_MAX / 2)
                    codes = half.sq.compute_codes(held)
                else:
                    codes = half.sq.compute_codes(vectors)
                    for row in range(0, size, _ERROR_ROWS):
                        exact = vectors[row:row + _ERROR_ROWS].astype(np.float64)
                        back = half.sq.decode(codes[row:row + _ERROR_ROWS])
                        list_errors[number] = max(list_errors[number],
                                                  float(np.sqrt(((exact - back) ** 2).sum(axis=1)).max()))
                        list_norms[number] = max(list_norms[number],
                                                 float(np.sqrt((exact ** 2).sum(axis=1)).max()))
                    error, max_norm = max(error, list_errors[number]), max(max_norm, list_norms[number])
                half.invlists.add_entries(number, size, faiss.swig_ptr(ids), faiss.swig_ptr(codes))  # type: ignore[union-attr]
        finally:
            faiss.omp_set_num_threads(threads)
        half.ntotal = flat.ntotal
        sizes = np.array([lists.list_size(number) for number in range(int(flat.nlist))])
        if flat.ntotal and np.isinf(list_errors[sizes > 0]).all():
            return None  # nothing the copy could settle
        # the candidates' float32 vectors are read by id (the lists hold the user's ids)
        if flat.direct_map.type == faiss.DirectMap.NoMap:  # type: ignore[attr-defined]
            flat.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
        return cls(half, flat, error, max_norm, list_errors, list_norms)

    def bounds(self, assign: np.ndarray | None, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Per query row, (the error bound, the largest norm) of the lists it probed (`assign`,
        -1 for none), or of the whole copy without an assignment."""
        if assign is None or self.list_errors is None or self.list_norms is None:
            return np.full(rows, self.error), np.full(rows, self.max_norm)
        probed = assign >= 0
        lists = np.maximum(assign, 0)
        return (np.where(probed, self.list_errors[lists], 0.0).max(axis=1, initial=0.0),
                np.where(probed, self.list_norms[lists], 0.0).max(axis=1, initial=0.0))

    def rerank(self, matrix: np.ndarray, found_d: np.ndarray, found_i: np.ndarray, k: int,
               higher_is_better: bool, assign: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(distances, ids, rows to search again) from the half-precision scan's candidates
        (`found_d`/`found_i`, (n, kept) best first, as FAISS returns them); `assign`: the lists
        each row probed (its bound is theirs), None: the whole copy's bound."""
        n, kept = found_i.shape
        d = int(self.flat.d)
        valid = found_i >= 0
        queries = np.ascontiguousarray(matrix, np.float32)
        exact = np.empty((n, kept), np.float32)
        # the kernels FAISS's IVF-Flat scanner calls, one (query, candidate) pair each
        kernel = faiss.fvec_inner_products_by_idx if higher_is_better else faiss.fvec_L2sqr_by_idx  # type: ignore[attr-defined]
        step = max(1, RERANK_BYTES // (kept * d * 4))
        for row in range(0, n, step):
            part = slice(row, row + step)
            rows = len(queries[part])
            vectors = np.zeros((rows * kept, d), np.float32)
            held = valid[part].ravel()
            if held.any():
                vectors[held] = self.flat.reconstruct_batch(found_i[part].ravel()[held])
            pairs = np.arange(rows * kept, dtype=np.int64)
            chunk_q = np.ascontiguousarray(queries[part])
            chunk_d = np.empty((rows, kept), np.float32)
            kernel(faiss.swig_ptr(chunk_d), faiss.swig_ptr(chunk_q), faiss.swig_ptr(vectors),
                   faiss.swig_ptr(pairs), d, rows, kept)
            exact[part] = chunk_d
        exact[~valid] = _MISSING[higher_is_better]
        top_d, top_i = merge_topk([exact], [found_i], k + 1, higher_is_better, ties_by_id=True)
        # fewer candidates than kept: the scan found no more, every vector probed is a candidate
        error, max_norm = self.bounds(assign, n)
        with np.errstate(invalid="ignore"):  # an unbounded list: inf - inf settles nothing
            settled = ~valid[:, -1] | self._excludes_the_rest(queries, found_d[:, -1], top_d[:, k - 1],
                                                               higher_is_better, error, max_norm)
        tie = (top_i[:, k] >= 0) & (top_d[:, k] == top_d[:, k - 1])
        return top_d[:, :k], top_i[:, :k], np.flatnonzero(~settled | tie)

    def _excludes_the_rest(self, queries: np.ndarray, last: np.ndarray, kth: np.ndarray,
                           higher_is_better: bool, error: np.ndarray, max_norm: np.ndarray) -> np.ndarray:
        """Is every vector the scan left out strictly worse than the k-th exact candidate, as FAISS
        would compute both (a bound on the true distance, then on float32's rounding of it)?"""
        last64, kth64 = last.astype(np.float64), kth.astype(np.float64)
        d = int(self.flat.d)
        rel, tiny = max(_ROUNDING, 4 * d * 2.0 ** -24), 4 * (d + 2) * _SUBNORMAL
        if not higher_is_better:
            # computed c of a true t: |c - t| <= rel t + tiny. The copy's true distance to what was
            # left out, at least last's; the true distance, at most `error` nearer; FAISS's float32.
            copy_distance = np.sqrt(np.maximum(last64 - tiny, 0) / (1 + rel))
            nearest = np.maximum(copy_distance - error * (1 + rel), 0)
            return (nearest > 0) & (nearest ** 2 * (1 - rel) - tiny > kth64)
        norms = np.sqrt((queries.astype(np.float64) ** 2).sum(axis=1))
        slack = rel * norms * (max_norm + error) + tiny
        return last64 + norms * error + 2 * slack < kth64
