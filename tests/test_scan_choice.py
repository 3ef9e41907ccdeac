"""query.scan_choice: a batch's bytes counted from the shard's own lists, and the choice they make."""

from __future__ import annotations

from types import SimpleNamespace

import faiss
import numpy as np

from shardserve.query.scan_choice import (
    READS_PER_CACHED_LIST,
    READS_PER_LIST,
    ScanChoice,
    batches_share_lists,
    cache_bytes,
    outgrows_cache,
    shares_scan,
)


def test_counts_pairs_and_distinct_lists_in_bytes() -> None:
    choice = ScanChoice(np.array([100, 0, 300, 50]), cache=0)  # list 1 is on another shard
    assign = np.array([[0, 2, 1], [2, 3, -1]])  # -1: no list (FAISS's answer when nprobe > nlist)
    counted = choice.count(assign)
    assert counted.pairs == 4  # list 1 and -1 read nothing here
    assert counted.pair_bytes == 100 + 300 + 300 + 50
    assert counted.distinct_bytes == 100 + 300 + 50
    assert counted.read_again == 300


def test_lists_larger_than_the_cache_read_often_enough_go_list_by_list() -> None:
    sizes = np.full(8, 4096)
    shared = np.array([[0, 1], [0, 1], [0, 2]])  # 6 reads of 3 lists: 2 each
    spread = np.array([[0, 1], [2, 3], [4, 5]])  # each list once
    assert READS_PER_LIST <= 2
    assert ScanChoice(sizes, cache=1024).by_lists(shared)
    assert not ScanChoice(sizes, cache=1024).by_lists(spread)  # nothing read again
    assert not ScanChoice(sizes, cache=1 << 20).by_lists(shared)  # they stay in cache: read 2x is not enough
    assert READS_PER_CACHED_LIST <= 5
    assert ScanChoice(sizes, cache=1 << 20).by_lists(np.zeros((5, 1), np.int64))  # one list read 5 times
    assert not ScanChoice(sizes, cache=1024).by_lists(shared[:1])  # one query shares nothing
    forced = ScanChoice(sizes, cache=1 << 20)
    forced.forced = True
    assert forced.by_lists(spread)


def test_a_shard_counts_its_own_lists_codes() -> None:
    rng = np.random.default_rng(3)
    quantizer = faiss.IndexFlatL2(16)
    ivf = faiss.IndexIVFFlat(quantizer, 16, 8)
    base = rng.normal(size=(2000, 16)).astype(np.float32)
    ivf.train(base)
    ivf.add(base)
    choice = ScanChoice.of(ivf, cache=0)
    assert choice.list_bytes.sum() == 2000 * 16 * 4  # every vector's code, once
    assert choice.mean_list_bytes == 2000 * 16 * 4 / 8


def test_the_cache_is_the_cores_unified_level_2_from_sysfs(tmp_path) -> None:
    def level(index: int, number: str, kind: str, size: str) -> None:
        entry = tmp_path / "cpu0" / "cache" / f"index{index}"
        entry.mkdir(parents=True)
        for name, value in (("level", number), ("type", kind), ("size", size)):
            (entry / name).write_text(value + "\n")

    level(0, "1", "Data", "32K")
    level(1, "1", "Instruction", "32K")
    level(2, "2", "Unified", "2048K")
    level(3, "3", "Unified", "32768K")
    assert cache_bytes(sys_cpu=tmp_path) == 2 << 20
    assert cache_bytes(cpu=1, sys_cpu=tmp_path) == 1 << 20  # no such core: the 1 MiB fallback


def test_a_batch_reading_nothing_here_goes_query_by_query() -> None:
    choice = ScanChoice(np.array([0, 0, 4096]), cache=0)
    assert not choice.by_lists(np.array([[0, 1], [0, 1], [-1, -1]]))  # lists held by other shards only


def test_batches_share_lists_where_ivf_flat_lists_outgrow_the_cache() -> None:
    mib = 1 << 20
    # 4M x 128 over 1024 lists: ~1.95 MiB a list, past a 1 MiB cache; 60K x 784 over 1024: ~180 KiB
    assert batches_share_lists("IVF1024,Flat", 4_000_000, 128, cache=mib)
    assert not batches_share_lists("IVF1024,Flat", 60_000, 784, cache=mib)
    assert not batches_share_lists("IVF1024,Flat", 4_000_000, 128, cache=4 * mib)  # a larger cache
    assert batches_share_lists("IVF1024_HNSW32,Flat", 4_000_000, 128, cache=mib)
    for factory in ("IVF1024,PQ16", "HNSW32", "Flat", "IVF1024,SQ8", "OPQ16,IVF1024,PQ16", "IVF0,Flat"):
        assert not batches_share_lists(factory, 4_000_000, 128, cache=mib), factory


def test_the_4m_lists_outgrow_a_1_or_2_mib_l2_and_60k_s_fit_in_either() -> None:
    """The rule was a list against the whole L2: at 4M x 128 over 1024 lists (1.95 MB a list) a
    host with a 2 MiB L2 engaged nothing of what a 1 MiB L2 engages. A list must fit in half the L2
    to stay in it."""
    mib = 1 << 20
    four_m, sixty_k = 4_000_000 * 128 * 4 / 1024, 60_000 * 784 * 4 / 1024
    for cache in (mib, 2 * mib, int(1.25 * mib)):
        assert outgrows_cache(four_m, cache) and not outgrows_cache(sixty_k, cache)
        assert batches_share_lists("IVF1024,Flat", 4_000_000, 128, cache=cache)
        assert not batches_share_lists("IVF1024,Flat", 60_000, 784, cache=cache)
        assert ScanChoice(np.full(1024, int(four_m)), cache=cache).memory_bound
        assert not ScanChoice(np.full(1024, int(sixty_k)), cache=cache).memory_bound


def test_batches_fill_and_run_one_per_replica_where_they_share_the_scan_unless_set() -> None:
    from deployments.config import AUTO_BATCH_FILL, OVERLAP_MIN_ROWS, AppArgs

    huge = SimpleNamespace(index_factory="IVF16,Flat", num_vectors=10**9, dim=128)  # lists of ~30 GB
    small = SimpleNamespace(index_factory="IVF1024,Flat", num_vectors=60_000, dim=784)  # ~180 KB
    assert shares_scan(huge) and not shares_scan(small)
    assert not shares_scan(SimpleNamespace(index_factory="HNSW32", num_vectors=10**9, dim=128))
    args = AppArgs(index="x", replicas_per_shard=2)
    assert args.fill_for(True) == AUTO_BATCH_FILL and args.fill_for(False) == 0.0
    # one batch per shard replica: a second would split the batch that shares the scan
    assert args.batching(True) == (2, 2, 1)
    assert args.batching(False) == (3, 2, OVERLAP_MIN_ROWS)
    assert AppArgs(index="x", batch_fill=0.0).fill_for(True) == 0.0  # what the user sets wins
    assert AppArgs(index="x", batch_fill=0.3).fill_for(False) == 0.3
    assert AppArgs(index="x", max_concurrent_batches=3).batching(True) == (3, 3, 1)


def test_the_edge_admits_a_shared_batch_where_batches_share_the_scan() -> None:
    from serving.edge import SHARED_SCAN_IN_FLIGHT, Admission, default_admission

    assert default_admission(False) == Admission()
    shared = default_admission(True)
    assert shared.max_in_flight == SHARED_SCAN_IN_FLIGHT >= 128  # the batch of 128 waiting clients
    assert shared.delay_ms == 0  # what is inside is never cut below a batch that shares the scan
    # everything else as by default: waiting clients (K + B of them) are never refused
    assert (shared.max_burst, shared.max_queue, shared.burst_ms) == (
        Admission().max_burst, Admission().max_queue, Admission().burst_ms)


def test_edge_flags_change_only_what_they_name_in_the_index_defaults() -> None:
    """`shardserve serve` starts from the index's admission (serving.edge.default_admission); a flag
    replaces its own field only: a queue alone keeps the K and D of a shared scan."""
    from serving.cli import _admission, parser
    from serving.edge import DEFAULT_BURST, SHARED_SCAN_IN_FLIGHT, Admission, default_admission

    args = parser().parse_args(["serve", "INDEX", "--edge-queue", "96"])
    shared = _admission(args, default_admission(True))
    assert (shared.max_in_flight, shared.delay_ms) == (SHARED_SCAN_IN_FLIGHT, 0)
    assert (shared.max_queue, shared.max_burst) == (96, 96)
    plain = _admission(parser().parse_args(["serve", "INDEX", "--edge-delay-ms", "40"]),
                       default_admission(False))
    assert (plain.max_in_flight, plain.delay_ms, plain.max_burst) == (Admission().max_in_flight, 40,
                                                                      DEFAULT_BURST)


def test_a_location_pyarrow_cannot_open_is_one_clear_error() -> None:
    import pytest

    from shardserve.errors import ShardserveError
    from shardserve.index.storage import Location

    with pytest.raises(ShardserveError, match="cannot open index location 'weird://x'"):
        Location.parse("weird://x")
