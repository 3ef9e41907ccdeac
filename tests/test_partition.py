"""How a build deals vectors to shards (index.partition): whole IVF lists per shard, neighbours
together, balanced by size, deterministic; rows mod S for every other index; and what the manifest records."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from index_build.job import build_index, rows_per_shard
from shardserve.data.datasets import load_dataset
from shardserve.index.indexes import prepare_vectors, train_empty_index
from shardserve.index.partition import BY_LISTS, BY_ROWS, Partition, assigner_of, local_owners
from shardserve.query.searcher import load_all_shards


def test_local_owners_keeps_neighbouring_lists_together_and_shards_equal() -> None:
    # two clusters of lists far apart on the first axis, sizes 1..8
    rng = np.random.default_rng(5)
    centroids = np.concatenate([rng.normal(0, 1, (8, 3)), rng.normal(0, 1, (8, 3)) + [50, 0, 0]])
    sizes = np.tile(np.arange(1, 9), 2)
    owners = local_owners(centroids, sizes, 2)
    assert len(set(owners[:8].tolist())) == 1 and len(set(owners[8:].tolist())) == 1  # a cluster each
    assert owners.tolist() == local_owners(centroids, sizes, 2).tolist()  # deterministic
    loads = np.bincount(owners, weights=sizes, minlength=2)
    assert loads[0] == loads[1]
    three = local_owners(centroids, sizes, 3)  # 1 : 2 split of the vectors, then 1 : 1
    assert sorted(set(three.tolist())) == [0, 1, 2]
    assert max(np.bincount(three, weights=sizes)) - min(np.bincount(three, weights=sizes)) <= sizes.max()
    assert sorted(local_owners(centroids[:4], np.zeros(4), 4).tolist()) == [0, 1, 2, 3]  # no sizes: count
    with pytest.raises(ValueError, match="cannot be dealt"):
        local_owners(centroids[:2], sizes[:2], 3)


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
    assert manifest.list_owners is not None and len(manifest.list_owners) == 40
    _, searchers = load_all_shards(str(tmp_path / "idx"), mmap=False)
    held = []
    for searcher in searchers:
        ivf = faiss.extract_index_ivf(searcher.index)
        held.append({lst for lst in range(ivf.nlist) if ivf.invlists.list_size(lst)})
    assert all(not (held[a] & held[b]) for a in range(3) for b in range(a + 1, 3))
    for shard, lists in enumerate(held):  # what the router is told is what each shard holds
        assert all(manifest.list_owners[lst] == shard for lst in lists)
    assert sum(s.index.ntotal for s in searchers) == manifest.num_vectors
