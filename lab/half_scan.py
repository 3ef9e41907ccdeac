"""What the half-precision scan (query.half_scan) saves, and whether it answers as FAISS does: one
shard's IVF-Flat batches in-process, one thread, warm page cache, scanned from the float32 lists
(the scan query.scan_choice picks) and from the half-precision copy, then answered with FAISS's
float32 distances.

Per batch size and shard: CPU ms per query of each, the rows the copy's bound settled (the rest are
searched again by FAISS), and whether every answer equals FAISS's own query-by-query scan (ids, and
distances bit for bit). A copy is made here whatever the list sizes (`--force`), to measure where
the shard would not make one.

    python -m lab.half_scan --index DIR_4M --dataset embedding-like --nprobe 32 --name half-scan-4m
"""

from __future__ import annotations

import numpy as np

from lab.scan_choice import batched, run
from lab.scan_cost import cpu_ms_per_query
from shardserve.query.half_scan import KEPT_FACTOR, HalfCopy


def measure(index: str, queries: np.ndarray, k: int, nprobe: int, batches: list[int],
            rounds: int) -> list[dict]:
    manifest, shards, by_batch = batched(index, queries, k, nprobe, batches)
    rows = []
    for shard in shards:
        assert shard.ivf is not None and shard.scan_choice is not None, f"{shard.name}: not IVF-Flat"
        half = shard.half or HalfCopy.of(shard.ivf)
        assert half is not None, f"{shard.name}: values beyond half precision"
        for batch, assigned in by_batch.items():
            n = batch * len(assigned)
            shard.half = None
            expected = [shard._scan(q.matrix, q.assign, q.coarse, k) for q in assigned]  # FAISS's own
            float32 = cpu_ms_per_query(assigned, n, shard.answer, rounds)
            shard.half = half
            halved = cpu_ms_per_query(assigned, n, shard.answer, rounds)
            answers = [shard.answer(q)[:2] for q in assigned]
            settled = 0
            for q in assigned:
                found = shard._scan_choosing(half.index, q.matrix, q.assign, q.coarse, KEPT_FACTOR * k, None,
                                             settle_ties=False)
                settled += len(q.matrix) - len(half.rerank(q.matrix, *found, k, manifest.metric != "l2")[2])
            pairs = list(zip(answers, expected, strict=True))
            same_ids = sum(int((got[1] == want[1]).all(axis=1).sum()) for got, want in pairs)
            same_bits = all(np.array_equal(got[0], want[0]) for got, want in pairs)
            rows.append({"batch": batch, "shard": shard.name, "float32_ms": float32, "half_ms": halved,
                         "half_vs_float32": round(halved / float32, 3), "settled": round(settled / n, 4),
                         "same_ids_as_faiss": round(same_ids / n, 4), "distances_bit_equal": same_bits,
                         "copy_error": round(half.error, 5),
                         "mean_list_kb": round(shard.scan_choice.mean_list_bytes / 1024, 1),
                         "scan_by_lists": bool(shard.scan_choice.by_lists(assigned[0].assign))})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    run(__doc__ or "", "half-scan", "1,32,128", measure, "half_scan",
        ["serving: see bench-scale-served.json"])


if __name__ == "__main__":
    main()
