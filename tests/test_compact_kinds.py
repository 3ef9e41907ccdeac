"""Compaction of every index kind that takes writes: the ones `--index auto` picks, the refined IVF-PQ
kinds, HNSW and a pre-transformed IVF. Writes go into the index's write log as the router appends
them (WriteLog.append), `compact` folds them, and the new version is checked point by point against
what the writes leave: each upserted id held once with the code its new vector gets from the trained
index, each deleted id gone, every kept point's code untouched, and searches (brute force says which
id is nearest) answering accordingly. A kind compaction cannot rewrite is refused for writes up
front."""

from __future__ import annotations

import re
from pathlib import Path

import faiss
import numpy as np
import pytest

from index_build.compact import compact
from index_build.job import build_index
from serving.evaluate import sharded_search
from shardserve.data.datasets import load_dataset
from shardserve.errors import ShardserveError
from shardserve.index.assigner import load_assigner
from shardserve.index.auto_index import choose_factory
from shardserve.index.indexes import index_from_bytes, make_empty_index, supported_params
from shardserve.index.manifest import Manifest, read_manifest, read_shard_checked
from shardserve.index.removal import writes_refused
from shardserve.index.storage import Location
from shardserve.query.searcher import ShardSearcher
from shardserve.writes.log import WriteLog, log_path
from shardserve.writes.ops import Delete, Upsert

ROWS, DIM, SHARDS = 4000, 16, 2
DATASET = f"synthetic:{ROWS}x{DIM}"  # ids are row numbers
GiB = 2**30


def _auto_kinds() -> list[str]:
    """Each factory `--index auto` picks for data of DIM dimensions (its four rules), with 64 lists."""
    many = 50_000_000
    picks = [choose_factory(10_000, DIM, GiB), choose_factory(500_000, DIM, GiB),
             choose_factory(many, DIM, 50 * many), choose_factory(many, DIM, 20 * many)]
    kinds = [re.sub(r"IVF\d+", "IVF64", factory) for factory, _ in picks]
    assert len(set(kinds)) == 4 and kinds[0] == "Flat" and kinds[2].endswith("Refine(SQ8)")
    return kinds


KINDS = [*_auto_kinds(), "IVF64,PQ16x4fs,RFlat", "IVF64,PQ16,Refine(SQ8)", "IVF64,PQ16", "HNSW16",
         "HNSW16,SQ8", "OPQ4,IVF64,PQ4"]
CODES_ONLY = {"IVF64,PQ4x4fs", "IVF64,PQ16", "OPQ4,IVF64,PQ4"}  # ranked on PQ codes alone


def _write(index: Path, base: np.ndarray) -> tuple[dict[int, np.ndarray], set[int], dict[int, np.ndarray]]:
    """Upserts (new ids, overwrites of base ids, an id written twice, a deleted id written again) and
    deletes (of base ids and of new ones), appended to the index's log: (each id's vector after
    them, the ids deleted, the upserted ids' new vectors)."""
    rng = np.random.default_rng(3)
    log = WriteLog(log_path(str(index)))  # type: ignore[arg-type]
    live = {i: base[i] for i in range(ROWS)}

    def near_base(n: int) -> np.ndarray:  # where the data is, a little off any base point
        return base[rng.choice(ROWS, n, replace=False)] + rng.normal(0, 0.1, (n, DIM)).astype(np.float32)

    def upsert(ids: list[int], vectors: np.ndarray) -> None:
        log.append([Upsert(i, v) for i, v in zip(ids, vectors, strict=True)])
        live.update(zip(ids, vectors, strict=True))

    def delete(ids: list[int]) -> None:
        log.append([Delete(i) for i in ids])
        for i in ids:
            live.pop(i, None)

    touched = rng.choice(ROWS, 100, replace=False).tolist()
    for round_ in range(5):
        upsert([10_000 + 10 * round_ + i for i in range(10)], near_base(10))  # new ids
        upsert(touched[10 * round_:10 * round_ + 10], near_base(10))  # overwrites of base ids
        delete(touched[50 + 10 * round_:50 + 10 * round_ + 10] + [10_000 + 10 * round_])  # base + new
    upsert([10_001], near_base(1))  # written twice: the last wins
    upsert([touched[50]], near_base(1))  # deleted, then written again
    delete([touched[0]])  # overwritten, then deleted
    log.close()
    deleted = (set(range(ROWS)) | set(range(10_000, 10_050))) - set(live)
    upserted = {i: v for i, v in live.items() if i >= 10_000 or i in touched}
    return live, deleted, upserted


def _codes(index: faiss.Index) -> dict[int, bytes]:
    """What an index stores for each id it holds (an IndexIDMap's inner index: for each position),
    in bytes that do not depend on where it sits: an IVF point's list and code (unpacked), a refined
    point's base and refine codes, a flat or graph index's stored vector or code."""
    owner, index = index, faiss.downcast_index(index)  # `owner` keeps the C++ object alive
    if isinstance(index, faiss.IndexIDMap):
        by_position = _codes(index.index)
        ids = faiss.vector_to_array(index.id_map)  # type: ignore[attr-defined]
        assert sorted(by_position) == list(range(len(ids))) and len(set(ids.tolist())) == len(ids)
        return {int(ids[p]): code for p, code in by_position.items()}
    if isinstance(index, faiss.IndexIVF):
        assert index.invlists is not None
        lists, size_of, codes = faiss.downcast_InvertedLists(index.invlists), index.code_size, {}
        # fast-scan lists are packed in blocks (their get_single_code reads other entries' codes)
        packer = lists.packer if isinstance(lists, faiss.BlockInvertedLists) else None  # type: ignore[attr-defined]
        for number in range(index.nlist):
            size = lists.list_size(number)
            ids = faiss.rev_swig_ptr(lists.get_ids(number), size).tolist() if size else []
            stored = lists.get_codes(number)
            for offset, id_ in enumerate(ids):
                code = np.zeros(size_of, np.uint8)
                if packer is not None:
                    packer.unpack_1_c(stored, offset, faiss.swig_ptr(code))
                else:
                    start = offset * size_of
                    code[:] = faiss.rev_swig_ptr(stored, size * size_of)[start:start + size_of]
                assert id_ not in codes, f"id {id_} held twice"
                codes[id_] = number.to_bytes(4, "little") + code.tobytes()
        return codes
    if isinstance(index, faiss.IndexRefine):
        base, refine = _codes(index.base_index), _codes(index.refine_index)
        assert sorted(base) == sorted(refine) == list(range(index.ntotal))
        return {p: base[p] + refine[p] for p in base}
    if isinstance(index, faiss.IndexPreTransform):
        return _codes(index.index)
    if isinstance(index, faiss.IndexHNSW):
        return _codes(index.storage)
    assert isinstance(index, faiss.IndexFlatCodes), type(index)
    rows = faiss.vector_to_array(index.codes).reshape(index.ntotal, index.code_size)  # type: ignore[attr-defined]
    del owner
    return {p: row.tobytes() for p, row in enumerate(rows)}


def _held(location: Location, manifest: Manifest) -> dict[int, bytes]:
    """Every id a version's shards hold, with what it stores (no id in two shards)."""
    held: dict[int, bytes] = {}
    for entry in manifest.shards:
        shard = _codes(index_from_bytes(read_shard_checked(location, entry)))
        assert not set(shard) & set(held)
        held.update(shard)
    return held


@pytest.mark.parametrize("factory", KINDS)
def test_every_kind_that_takes_writes_compacts_exactly(tmp_path: Path, factory: str) -> None:
    index = tmp_path / "idx"
    built = build_index(DATASET, SHARDS, factory, str(index), backend="local")
    location = Location.parse(str(index))
    base = load_dataset(DATASET).base
    live, deleted, upserted = _write(index, base)
    before = _held(location, built)

    compacted = compact(str(index))

    after = _held(location, compacted)
    assert sorted(after) == sorted(live) and compacted.num_vectors == len(live)
    # each upsert stored as the trained index stores its new vector; each point nobody wrote as it was
    trained = index_from_bytes(read_shard_checked(location, built.trained))  # type: ignore[arg-type]
    ids = sorted(upserted)
    trained.add_with_ids(np.stack([upserted[i] for i in ids]), np.array(ids, np.int64))
    expected = _codes(trained)
    assert [i for i in ids if after[i] != expected[i]] == []
    assert [i for i in live if i not in upserted and after[i] != before[i]] == []

    # searched as served, every list probed: a query at each upsert's new vector finds it (brute
    # force: no other point is nearer); for kinds ranked on PQ codes alone, whose 4-bit distances tie
    # often, the answers are scored as an index built of exactly the live points scores them (the
    # same top-k distances); no answer holds a deleted id
    searchers = [ShardSearcher.load(location, read_manifest(location), s) for s in range(SHARDS)]
    params = {"nprobe": 64} if "nprobe" in supported_params(factory, DIM, "l2") else (
        {"efSearch": 128} if "HNSW" in factory else {})
    queries = np.stack([upserted[i] for i in ids] + [base[i] for i in sorted(deleted) if i < ROWS])
    distances, found = sharded_search(searchers, queries, 10, params, "l2", load_assigner(str(index)))
    assert not set(found.ravel().tolist()) & deleted
    live_ids = np.array(sorted(live), np.int64)
    live_vectors = np.stack([live[i] for i in live_ids.tolist()])
    truth = live_ids[np.argmin(((queries[:len(ids), None, :] - live_vectors[None]) ** 2).sum(-1), axis=1)]
    assert truth.tolist() == ids  # brute force over the live points: each upsert is its query's nearest
    if factory not in CODES_ONLY:
        hits = [i in row for i, row in zip(ids, found[:len(ids)].tolist(), strict=True)]
        assert all(hits), f"{factory}: {hits.count(False)} of {len(ids)} upserts not found at their vector"
    else:
        rebuilt = index_from_bytes(read_shard_checked(location, built.trained))  # type: ignore[arg-type]
        rebuilt.add_with_ids(live_vectors, live_ids)
        reference = sharded_search([ShardSearcher(rebuilt, "l2", "all", "v")], queries, 10, params, "l2",
                                   load_assigner(str(index)))[0]
        np.testing.assert_allclose(distances, reference, rtol=1e-5)


@pytest.mark.parametrize("factory", KINDS)
def test_a_kind_that_compacts_takes_writes(factory: str) -> None:
    assert writes_refused(factory, DIM, "l2") is None


@pytest.mark.parametrize(("factory", "kind"), [
    ("IVF16,PQ8+16", "IndexIVFPQR"), ("NSG16", "IndexNSGFlat"), ("PQ8x4fs", "IndexPQFastScan"),
    ("IDMap2,HNSW8", "IndexIDMap2")])
def test_a_kind_compaction_cannot_rewrite_is_refused_for_writes_naming_it(factory: str, kind: str) -> None:
    make_empty_index(factory, DIM, "l2")  # a factory the build takes
    reason = writes_refused(factory, DIM, "l2")
    assert reason is not None and kind in reason and factory in reason


def test_compacting_a_kind_that_cannot_be_rewritten_fails_naming_it_and_publishes_nothing(
        tmp_path: Path) -> None:
    index = tmp_path / "idx"
    built = build_index(DATASET, SHARDS, "IVF16,PQ8+16", str(index), backend="local")
    log = WriteLog(log_path(str(index)))  # type: ignore[arg-type]
    log.append([Delete(1), Delete(2)])  # the router refuses it (writes_refused); a log can hold it
    log.close()
    with pytest.raises(ShardserveError, match="IndexIVFPQR"):
        compact(str(index))
    assert read_manifest(Location.parse(str(index))).index_version == built.index_version
    assert len(list((index / "versions").iterdir())) == 1
