"""FAISS index construction: factory validation, the one shared training step, per-shard adds.

Why one trained empty index for every shard: with shared IVF centroids (and PQ codebooks), searching
nprobe lists in every shard and merging returns exactly what the unsharded index returns.
"""

from __future__ import annotations

import faiss
import numpy as np

from shardserve.errors import ShardserveError

FAISS_METRIC = {"l2": faiss.METRIC_L2, "ip": faiss.METRIC_INNER_PRODUCT,
                "cosine": faiss.METRIC_INNER_PRODUCT}


def prepare_vectors(vectors: np.ndarray, metric: str) -> np.ndarray:
    """float32, C-contiguous, and L2-normalised for cosine (so inner product = cosine similarity)."""
    prepared = np.array(vectors, dtype=np.float32, order="C", copy=True)
    if metric == "cosine":
        faiss.normalize_L2(prepared)
    return prepared


# From this many query rows, FAISS's flat distance computations (the router's coarse quantizer, a
# flat shard) run as one BLAS matrix product. FAISS switches by rows x dim against a process-wide
# threshold whose default (128,000) means BLAS only from 164 rows at d=784, but a router batch under
# load holds a few dozen rows at most, and BLAS costs less per query from a handful of rows on (the
# lists picked are the same). Where the two paths cross depends on the machine: `python -m
# lab.blas_rows` finds it.
BLAS_MIN_ROWS = 6


def flat_search_with_blas_from(rows: int, dim: int) -> None:
    """FAISS computes flat distances with BLAS for batches of at least `rows` rows of `dim`
    dimensions, with its own per-query kernels below that (better for a single query).

    Process-wide, so only a serving process sets it (router, shard replica: deployments/), once,
    at load, never library code: the two paths round distances differently, and a (cosine) build in
    a process that changes it half-way comes out different from the same build without the change."""
    faiss.cvar.distance_compute_blas_threshold = min(max(rows * dim - 1, 0), 2**31 - 1)  # a C int


# A refine step re-ranks this many times k candidates of the compressed index with exact (or 8-bit)
# distances. 4-bit fast-scan codes of 128-d data order the near neighbours poorly: with only a few
# times k candidates, the true top k is often not among them at all; re-ranking 16k of them costs
# little next to the list scan. Stored in each index file.
REFINE_K_FACTOR = 16.0


def make_empty_index(factory: str, dim: int, metric: str) -> faiss.Index:
    """Build the untrained index; ids are stored explicitly so shards return global row ids."""
    if metric not in FAISS_METRIC:
        raise ShardserveError(f"unknown metric {metric!r}: use l2, ip or cosine")
    try:
        index = faiss.index_factory(dim, factory, FAISS_METRIC[metric])
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else "rejected by FAISS"
        raise ShardserveError(f"unknown index factory {factory!r} for dim {dim}: {reason}") from None
    _no_polysemous_training(index)
    if not isinstance(faiss.downcast_index(index), faiss.IndexIVF):
        # Flat / HNSW / PQ / refined IVF keep sequential ids only: an IDMap makes add_with_ids possible.
        index = faiss.IndexIDMap2(index)
    refine = unwrap_id_map(index)
    if isinstance(refine, faiss.IndexRefine):
        refine.k_factor = REFINE_K_FACTOR  # stored in the index file; the factory's RFlat means 1
    return index


def _no_polysemous_training(index: faiss.Index) -> None:
    """The factory turns on polysemous training for 8-bit PQ: an annealing that reorders each
    sub-quantizer's centroids so that Hamming distances between codes approximate real ones. Only a
    polysemous search (`polysemous_ht`) reads that order; shardserve never runs one, and the
    annealing is most of an IVF-PQ's training time on small and medium data."""
    ivf = faiss.try_extract_index_ivf(index)
    for part in (faiss.downcast_index(ivf) if ivf is not None else None, faiss.downcast_index(index)):
        if isinstance(part, faiss.IndexIVFPQ | faiss.IndexPQ):
            part.do_polysemous_training = False  # type: ignore[union-attr]


def train_empty_index(factory: str, metric: str, train_vectors: np.ndarray, seed: int) -> bytes:
    """Train once on a sample and return the serialized, still-empty index every shard copies."""
    index = make_empty_index(factory, train_vectors.shape[1], metric)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        if len(train_vectors) < ivf.nlist:
            raise ShardserveError(
                f"{factory!r} needs at least {ivf.nlist} training vectors, the dataset has "
                f"{len(train_vectors)}: use fewer lists or more data"
            )
        ivf.cp.seed = seed
    if not index.is_trained:
        index.train(train_vectors)
    assert index.ntotal == 0, "the shared trained index must be empty"
    return faiss.serialize_index(index).tobytes()


def add_to_copy(empty_index: bytes, vectors: np.ndarray, ids: np.ndarray) -> faiss.Index:
    """Deserialize a copy of the trained empty index and add `vectors` under their global `ids`."""
    index = faiss.deserialize_index(np.frombuffer(empty_index, dtype=np.uint8))
    assert index.ntotal == 0 and index.is_trained
    if len(vectors):
        index.add_with_ids(vectors, np.ascontiguousarray(ids, dtype=np.int64))
    return index


def index_to_bytes(index: faiss.Index) -> bytes:
    return faiss.serialize_index(index).tobytes()


def index_from_bytes(data: bytes) -> faiss.Index:
    return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))


def unwrap_id_map(index: faiss.Index) -> faiss.Index:
    """The index inside an IndexIDMap(2) wrapper, downcast; `index` itself otherwise.

    The returned proxy does not own its C++ object: the caller must keep `index` referenced while
    it uses the result (dropping the wrapper first frees the inner index: a segfault under HNSW/Flat).
    """
    if isinstance(index, faiss.IndexIDMap):
        return faiss.downcast_index(index.index)
    return faiss.downcast_index(index)


def search_params(index: faiss.Index, params: dict[str, int] | None,
                  sel: faiss.IDSelector | None = None) -> faiss.SearchParameters | None:
    """Per-request parameters as a FAISS SearchParameters object (never mutate a shared index).

    Supported keys: `nprobe` (IVF), `efSearch` (HNSW). A key the index cannot use is an error.
    `sel`: only ids it holds may be returned (a metadata filter, pushed into the scan).
    """
    if not params and sel is None:
        return None
    params = params or {}
    unknown = set(params) - {"nprobe", "efSearch"}
    if unknown:
        raise ShardserveError(f"unknown search param(s) {sorted(unknown)}: use nprobe or efSearch")
    inner = unwrap_id_map(index)
    refine = inner if isinstance(inner, faiss.IndexRefine) else None
    base = faiss.downcast_index(refine.base_index) if refine is not None else inner
    ivf = faiss.try_extract_index_ivf(base)
    if "nprobe" in params:
        if ivf is None:
            raise ShardserveError("param nprobe needs an IVF index")
        chosen: faiss.SearchParameters = faiss.SearchParametersIVF(nprobe=int(params["nprobe"]))
    elif "efSearch" in params:
        if not isinstance(base, faiss.IndexHNSW):
            raise ShardserveError("param efSearch needs an HNSW index")
        chosen = faiss.SearchParametersHNSW(efSearch=int(params["efSearch"]))  # type: ignore[attr-defined]
    elif ivf is not None:  # a selector alone: the index's own nprobe (the parameters' default is 1)
        chosen = faiss.SearchParametersIVF(nprobe=int(ivf.nprobe))
    elif isinstance(base, faiss.IndexHNSW):
        chosen = faiss.SearchParametersHNSW(efSearch=int(base.hnsw.efSearch))  # type: ignore[attr-defined]
    else:
        chosen = faiss.SearchParameters()
    if sel is not None:
        chosen.sel = sel
        chosen.referenced_objects = [sel]  # type: ignore[attr-defined]  # SWIG keeps a raw pointer
    if refine is None:
        return chosen
    # IndexRefine takes its own parameter type, carrying the base index's; keep the stored k_factor.
    wrapped = faiss.IndexRefineSearchParameters(k_factor=refine.k_factor, base_index_params=chosen)
    wrapped.referenced_objects = [chosen]  # type: ignore[attr-defined]  # SWIG holds a raw pointer to `chosen`
    return wrapped


def supported_params(factory: str, dim: int, metric: str) -> frozenset[str]:
    """Which per-request params an index built from `factory` understands."""
    index = make_empty_index(factory, dim, metric)  # keep the owner alive while `inner` is used
    inner = unwrap_id_map(index)
    if isinstance(inner, faiss.IndexRefine):
        inner = faiss.downcast_index(inner.base_index)
    if faiss.try_extract_index_ivf(inner) is not None:
        return frozenset({"nprobe"})
    if isinstance(inner, faiss.IndexHNSW):
        return frozenset({"efSearch"})
    return frozenset()


def stored_points(index: faiss.Index) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, vectors) of every point an index stores, when it stores the vectors themselves (an IVF
    with flat codes, a flat index under an id map); None for kinds that keep only compressed codes
    or a graph (PQ, SQ, HNSW), whose stored points are not the vectors that were added."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and type(faiss.downcast_index(ivf)) is faiss.IndexIVFFlat:  # not Dedup: it shares
        lists, dim = ivf.invlists, ivf.d
        assert lists is not None
        ids, vectors = [np.zeros(0, np.int64)], [np.zeros((0, dim), np.float32)]
        for number in range(ivf.nlist):
            size = lists.list_size(number)
            if size:
                ids.append(faiss.rev_swig_ptr(lists.get_ids(number), size).astype(np.int64))
                codes = faiss.rev_swig_ptr(lists.get_codes(number), size * lists.code_size)
                vectors.append(np.frombuffer(codes.tobytes(), np.float32).reshape(size, dim))
        return np.concatenate(ids), np.concatenate(vectors)
    flat = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap) else None
    if isinstance(flat, faiss.IndexFlat):
        return (faiss.vector_to_array(index.id_map).astype(np.int64),  # type: ignore[attr-defined]
                faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d).copy())
    return None
