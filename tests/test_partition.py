"""How a build deals vectors to shards (index.partition): whole IVF lists per shard, balanced by size,
deterministic; rows mod S for every other index; and what the manifest records."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from index_build.job import build_index, rows_per_shard
from shardserve.data.datasets import load_dataset
from shardserve.index.indexes import prepare_vectors, train_empty_index
from shardserve.index.partition import BY_LISTS, BY_ROWS, Partition, assigner_of, balanced_owners
from shardserve.query.searcher import load_all_shards


def test_balanced_owners_puts_the_largest_lists_first_on_the_lightest_shard() -> None:
    owners = balanced_owners(np.array([5, 1, 9, 3, 3, 7]), 2)
    # 9 → 0, 7 → 1, 5 → 1, 3 → 0, 3 → 0 (a tie: the lower shard), 1 → 1: loads 15 and 13
    assert owners.tolist() == [1, 1, 0, 0, 0, 1]
    assert owners.tolist() == balanced_owners(np.array([5, 1, 9, 3, 3, 7]), 2).tolist()  # deterministic
    assert balanced_owners(np.zeros(3, np.int64), 4).tolist() == [0, 1, 2]  # empty lists still spread


def test_every_list_lives_in_exactly_one_shard_and_every_row_in_one() -> None:
    data = load_dataset("synthetic:6000x16")
    vectors = prepare_vectors(data.base, "l2")
    empty = train_empty_index("IVF40,Flat", "l2", vectors, seed=3)
    partition = Partition.plan(empty, vectors, 3)
    assert partition.kind == BY_LISTS and sorted(set(partition.owners.tolist())) == [0, 1, 2]
    with pytest.raises(ValueError, match="quantizer"):  # by list, a row number alone decides nothing
        partition.shard_of(np.arange(3))
    rows = rows_per_shard(partition, empty, vectors)
    assert np.array_equal(np.sort(np.concatenate(rows)), np.arange(len(vectors)))
    assigner = assigner_of(empty)  # holds the index its quantizer lives in
    _, lists = assigner.quantizer.search(vectors, 1)
    for shard, mine in enumerate(rows):
        assert set(partition.owners[lists[mine, 0]].tolist()) == {shard}
    sizes = [len(r) for r in rows]
    assert max(sizes) <= 1.2 * min(sizes), sizes  # balanced by the sample's list sizes
    assert partition.describe() == {"kind": BY_LISTS,
                                     "lists_per_shard": np.bincount(partition.owners, minlength=3).tolist()}


@pytest.mark.parametrize("factory", ["Flat", "HNSW8", "IVF16,Flat,Refine(Flat)"])
def test_indexes_the_router_does_not_quantize_for_are_dealt_by_row(factory: str) -> None:
    vectors = prepare_vectors(load_dataset("synthetic:2000x16").base, "l2")
    empty = train_empty_index(factory, "l2", vectors, seed=3)
    partition = Partition.plan(empty, vectors, 4)
    assert partition.kind == BY_ROWS and partition.describe() == {"kind": BY_ROWS}
    rows = rows_per_shard(partition, empty, vectors)
    assert all(np.array_equal(mine, np.arange(s, len(vectors), 4)) for s, mine in enumerate(rows))


def test_a_built_ivf_index_records_its_partition_and_its_shards_hold_disjoint_lists(tmp_path: Path) -> None:
    manifest = build_index("synthetic:6000x16", 3, "IVF40,Flat", str(tmp_path / "idx"), backend="local")
    assert manifest.build.params["partition"]["kind"] == BY_LISTS
    _, searchers = load_all_shards(str(tmp_path / "idx"), mmap=False)
    held = []
    for searcher in searchers:
        ivf = faiss.extract_index_ivf(searcher.index)
        held.append({lst for lst in range(ivf.nlist) if ivf.invlists.list_size(lst)})
    assert all(not (held[a] & held[b]) for a in range(3) for b in range(a + 1, 3))
    assert sum(s.index.ntotal for s in searchers) == manifest.num_vectors
