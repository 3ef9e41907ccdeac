"""Would a cache-blocked list scan of our own beat FAISS's, per (query, list) pair, at 4M?

The shipped list-by-list scan (query.list_scan) hands FAISS the batch's (query, list) pairs sorted by
list: each pair is a one-probe search, so a list is streamed once per pair, the second time from
L3. lab/blocked_scan.cpp reads each list in blocks that every pair scans while the block is in L1,
with an AVX2 distance loop and FAISS's own distance for the few vectors that could enter a pair's
top (so the answers are FAISS's, bit for bit; this harness asserts it on every batch).

Per batch size: CPU ms per query (all shards, process time, best of rounds, in-process, one
thread, warm page cache) of FAISS's pairs and of the blocked scan, and the share of vectors the
blocked scan measured exactly. Needs g++ and a CPU with AVX2 and FMA; L2 indexes only.

    python -m lab.blocked_scan --index DIR_4M --nprobe 32
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

import faiss
import numpy as np

from lab.scan_choice import queries_for
from lab.scan_cost import cpu_ms_per_query
from loadtests.record import header, save
from shardserve.index.assigner import CoarseAssigner
from shardserve.index.indexes import prepare_vectors
from shardserve.index.storage import Location
from shardserve.query.scan_choice import cache_bytes
from shardserve.query.searcher import ShardSearcher, load_all_shards

SOURCE = Path(__file__).with_suffix(".cpp")
_P = ctypes.c_void_p


def compile_kernel(work: Path) -> ctypes.CDLL:
    flags = set(Path("/proc/cpuinfo").read_text().split())
    if not {"avx2", "fma"} <= flags:
        raise SystemExit("error: the blocked scan needs AVX2 and FMA")
    out = work / "blocked_scan.so"
    subprocess.run(["g++", "-O3", "-shared", "-fPIC", "-o", str(out), str(SOURCE)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.blocked_scan_l2.restype = ctypes.c_int64
    return lib


def faiss_l2() -> int:
    """The address of FAISS's own fvec_L2sqr (the function its IVF-Flat scanner measures with)."""
    libfaiss = ctypes.CDLL(str(Path(faiss.__file__).parent / "libfaiss.so"))
    return ctypes.cast(libfaiss._ZN5faiss10fvec_L2sqrEPKfS1_m, _P).value or 0


def list_pointers(shard: ShardSearcher) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lists = shard.ivf.invlists
    codes, ids, sizes = (np.zeros(shard.ivf.nlist, t) for t in (np.uint64, np.uint64, np.int64))
    for number in range(shard.ivf.nlist):
        sizes[number] = lists.list_size(number)
        if sizes[number]:
            codes[number] = faiss.rev_swig_ptr(lists.get_codes(number), 1).ctypes.data
            ids[number] = faiss.rev_swig_ptr(lists.get_ids(number), 1).ctypes.data
    return codes, ids, sizes


def pairs_of(shard: ShardSearcher, assign: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(query row, list) of the batch's pairs held by the shard, sorted by list (query.list_scan's order)."""
    assert shard.nonempty is not None
    rows, probes = np.nonzero(shard.nonempty[assign])
    lists = assign[rows, probes]
    order = np.argsort(lists, kind="stable")
    return rows[order].astype(np.int64), lists[order].astype(np.int64)


def faiss_pairs(shard: ShardSearcher, matrix: np.ndarray, assign: np.ndarray, coarse: np.ndarray,
                kept: int) -> tuple[np.ndarray, np.ndarray]:
    rows, lists = pairs_of(shard, assign)
    pair_matrix = np.ascontiguousarray(matrix[rows])
    pair_lists = np.ascontiguousarray(lists[:, None])
    pair_coarse = np.zeros((len(rows), 1), np.float32)
    d = np.empty((len(rows), kept), np.float32)
    i = np.empty((len(rows), kept), np.int64)
    shard.ivf.search_preassigned_c(len(rows), faiss.swig_ptr(pair_matrix), kept, faiss.swig_ptr(pair_lists),
                                   faiss.swig_ptr(pair_coarse), faiss.swig_ptr(d), faiss.swig_ptr(i), False,
                                   faiss.SearchParametersIVF(nprobe=1))
    return d, i


def blocked_pairs(lib: ctypes.CDLL, exact: int, pointers: tuple, shard: ShardSearcher, matrix: np.ndarray,
                  assign: np.ndarray, kept: int, block: int,
                  measured: list[int]) -> tuple[np.ndarray, np.ndarray]:
    rows, lists = pairs_of(shard, assign)
    starts = np.flatnonzero(np.r_[True, lists[1:] != lists[:-1]]) if len(lists) else np.zeros(0, np.int64)
    group_list = np.ascontiguousarray(lists[starts])
    group_start = np.ascontiguousarray(np.r_[starts, len(lists)].astype(np.int64))
    codes, ids, sizes = pointers
    d = np.empty((len(rows), kept), np.float32)
    i = np.empty((len(rows), kept), np.int64)
    m = np.ascontiguousarray(matrix, np.float32)
    n = lib.blocked_scan_l2(ctypes.c_int64(len(group_list)), group_list.ctypes.data_as(_P),
                            group_start.ctypes.data_as(_P), rows.ctypes.data_as(_P), m.ctypes.data_as(_P),
                            ctypes.c_int64(m.shape[1]), codes.ctypes.data_as(_P), ids.ctypes.data_as(_P),
                            sizes.ctypes.data_as(_P), ctypes.c_int64(kept), _P(exact), ctypes.c_int64(block),
                            d.ctypes.data_as(_P), i.ctypes.data_as(_P))
    if n < 0:
        raise SystemExit("error: the blocked scan needs a dimension that is a multiple of 8")
    measured.append(int(n))
    return d, i


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--index", required=True)
    cli.add_argument("--dataset", default="embedding-like", help="a dataset name, or embedding-like")
    cli.add_argument("--queries", type=int, default=512)
    cli.add_argument("--nprobe", type=int, default=32)
    cli.add_argument("--k", type=int, default=10)
    cli.add_argument("--batches", default="1,8,32,64,128,256")
    cli.add_argument("--block", type=int, default=64, help="vectors per block (64 x 128 floats: 32 KB)")
    cli.add_argument("--rounds", type=int, default=2)
    cli.add_argument("--name", default="blocked-scan-4m")
    args = cli.parse_args()
    faiss.omp_set_num_threads(1)  # as in every shard replica
    manifest, shards = load_all_shards(args.index)
    if manifest.metric != "l2" or any(shard.nonempty is None for shard in shards):
        raise SystemExit("error: an IVF-Flat L2 index only")
    assigner = CoarseAssigner.load(Location.parse(args.index), manifest)
    prepared = prepare_vectors(queries_for(args.dataset, manifest.dim, args.queries), manifest.metric)
    kept = args.k + 1  # as query.list_scan keeps
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lib, exact = compile_kernel(Path(tmp)), faiss_l2()
        pointers = {shard.name: list_pointers(shard) for shard in shards}
        for batch in [int(b) for b in args.batches.split(",")]:
            work = [(shard, assigner.query(prepared[r:r + batch], args.k, {"nprobe": args.nprobe}))
                    for shard in shards for r in range(0, len(prepared) - batch + 1, batch)]
            assert all(q.assign is not None and q.coarse is not None for _, q in work)
            n = len(work) * batch // len(shards)
            pairs = sum(len(pairs_of(shard, q.assign)[0]) for shard, q in work)  # type: ignore[arg-type]
            for shard, q in work:  # the same answers, bit for bit
                want, got = faiss_pairs(shard, q.matrix, q.assign, q.coarse, kept), blocked_pairs(
                    lib, exact, pointers[shard.name], shard, q.matrix, q.assign, kept, args.block, [])
                assert np.array_equal(want[1], got[1]) and np.array_equal(want[0].view(np.int32),
                                                                          got[0].view(np.int32)), batch
            measured: list[int] = []

            def blocked_one(w: tuple, measured: list[int] = measured) -> object:
                return blocked_pairs(lib, exact, pointers[w[0].name], w[0], w[1].matrix, w[1].assign, kept,
                                     args.block, measured)
            by_faiss = cpu_ms_per_query(work, n, lambda w: faiss_pairs(w[0], w[1].matrix, w[1].assign,
                                                                       w[1].coarse, kept), args.rounds)
            blocked = cpu_ms_per_query(work, n, blocked_one, args.rounds)
            vectors = sum(int(pointers[shard.name][2][pairs_of(shard, q.assign)[1]].sum())  # type: ignore[arg-type]
                          for shard, q in work)
            rows.append({"batch": batch, "faiss_pairs_ms": by_faiss, "blocked_ms": blocked,
                         "blocked_vs_faiss": round(blocked / by_faiss, 3),
                         "pairs_per_query": round(pairs / n, 2),
                         "measured_exactly": round(sum(measured) / (vectors * args.rounds), 4)})
            print(rows[-1], flush=True)
    record = header(args.name, tool=None,
                    index={"version": manifest.index_version, "factory": manifest.index_factory,
                           "vectors": manifest.num_vectors, "shards": len(shards),
                           "params": {"nprobe": args.nprobe}},
                    queries=len(prepared), threads=1, cache_bytes=cache_bytes(), block=args.block,
                    unit="CPU ms per query over all shards (process time, best of rounds)",
                    answers="identical to FAISS's pairs (ids and distance bits), asserted on every batch",
                    blocked_scan=rows, not_covered=["serving", "inner product", "filters and tombstones"])
    print(f"record: {save(record)}")


if __name__ == "__main__":
    main()
