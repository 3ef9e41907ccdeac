"""A collection's next version: its write log folded in, and, the first time it holds `grow_at` rows
or more, built as the index its spec names.

A collection is born empty and exact (index_build.empty: one flat shard). While it is small, each
fold is a compaction (index_build.compact): the same flat index, plus what the log says. The fold
that finds `grow_at` live rows or more builds it instead, as a build from a dataset does
(index_build.publish): its own rows (the exact version's vectors minus every id the log touched,
plus each id's latest upsert, with their metadata) train the spec's index once (`auto`: chosen by
its rows, shardserve.index.auto_index), are dealt to the spec's shards and added per shard (Ray
Data when Ray runs here, as `shardserve build` does; one process otherwise). Its log position is
the last request folded in, so the requests after it are applied on top, as after any compaction:
no acknowledged write is lost, no deleted id returns.

The gate: before the grown version is published, its own rows are its queries. Recall@10 against
the exact neighbours among those rows must reach RECALL_TARGET, at the smallest nprobe (efSearch)
from the app's default up that reaches it; that is stored in each shard as the index's own default.
Below the target at every setting, nothing is published, the exact version keeps serving, and the
next fold tries again. A grown collection's later folds are compactions of the kind it grew into.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from index_build.compact import compact, latest_ops
from index_build.job import add_shards_local, add_shards_ray, rows_per_shard
from index_build.publish import BuildParams, publish_build, training_sample, write_shard
from shardserve.collection.catalogue import file_lock
from shardserve.collection.spec import CollectionSpec
from shardserve.errors import ShardserveError
from shardserve.index.auto_index import DEFAULT_MEMORY_BUDGET, choose_factory
from shardserve.index.indexes import index_from_bytes, index_to_bytes, unwrap_id_map
from shardserve.index.manifest import MANIFEST, VERSIONS_DIR, Manifest, read_manifest, read_shard_checked
from shardserve.index.metadata import MetadataTable, write_metadata
from shardserve.index.partition import Partition
from shardserve.index.storage import Location
from shardserve.query.merge import merge_topk
from shardserve.writes.locate import log_address, log_exists, open_log
from shardserve.writes.ops import Upsert

RECALL_TARGET = 0.99  # recall@10 of a grown version against exact neighbours, on its own rows
GATE_QUERIES = 200
GATE_K = 10
FIRST_PROBES = {"nprobe": 16, "efSearch": 64}  # the app's default search params (AppArgs.gate_params)
GROWN = "grown_from"  # a grown version's build parameter: the exact version it grew from


def grown(manifest: Manifest) -> bool:
    """Whether `manifest` is a collection's built (not exact) stage."""
    return GROWN in manifest.build.params


@dataclass(frozen=True)
class Rows:
    """A collection's live points at a log position: ids ascending, vectors as stored, metadata
    aligned with them (None without metadata columns)."""

    ids: np.ndarray
    vectors: np.ndarray
    metadata: pa.Table | None
    position: int


def live_rows(directory: str | Path, upto: int | None = None) -> Rows:
    """The live points of an exact collection at log position `upto` (default: the log's last)."""
    location = Location.parse(str(directory))
    current = read_manifest(location)
    ids, vectors, tables = [], [], []
    for shard, entry in enumerate(current.shards):
        index = index_from_bytes(read_shard_checked(location, entry))
        inner = unwrap_id_map(index)
        if not isinstance(inner, faiss.IndexFlat):
            raise ShardserveError(f"{directory}: {current.index_factory} is not an exact collection's index")
        ids.append(faiss.vector_to_array(index.id_map).astype(np.int64))  # type: ignore[attr-defined]
        vectors.append(inner.reconstruct_n(0, index.ntotal) if index.ntotal
                       else np.zeros((0, current.dim), np.float32))
        if current.metadata is not None:
            stored = MetadataTable.load(location, current.metadata[shard])
            tables.append(stored.table.take(pa.array(np.searchsorted(stored.ids, ids[-1]))))
    base_ids = np.concatenate(ids)
    base_vectors = np.concatenate(vectors)
    base_table = pa.concat_tables(tables) if tables else None
    upto, latest = _latest(directory, current, upto)
    keep = ~np.isin(base_ids, np.fromiter(latest, np.int64, len(latest)))
    upserts = [op for op in latest.values() if isinstance(op, Upsert)]
    all_ids = np.concatenate([base_ids[keep], np.array([op.id for op in upserts], np.int64)])
    all_vectors = np.concatenate([base_vectors[keep], np.array([op.vector for op in upserts], np.float32)
                                  .reshape(len(upserts), current.dim)])
    table: pa.Table | None = None
    if base_table is not None:
        added = pa.Table.from_pylist([op.metadata or {} for op in upserts], schema=base_table.schema)
        table = pa.concat_tables([base_table.take(pa.array(np.flatnonzero(keep))), added])
    order = np.argsort(all_ids, kind="stable")
    return Rows(all_ids[order], np.ascontiguousarray(all_vectors[order]),
                None if table is None else table.take(pa.array(order)), upto)


def fold(directory: str | Path, spec: CollectionSpec, backend: str = "local", may_grow: bool = True,
         refused: Callable[[int, Exception], None] | None = None) -> Manifest | None:
    """Publish `directory`'s next version: grown when it is exact and holds `spec.grow_at` live rows
    or more (and `may_grow`), else compacted; None when the log holds nothing past the served
    version. A growth that fails (its gate refusing, its training impossible) is told to `refused`
    (live rows, why) and the log is compacted instead: the collection stays exact and its deltas
    bounded, whatever its spec asks."""
    with _fold_lock(directory) as mine:
        if not mine:
            return None  # another process folds it now
        _sweep_unpublished(Location.parse(str(directory)))
        return _fold(directory, spec, backend, may_grow, refused)


def _fold(directory: str | Path, spec: CollectionSpec, backend: str, may_grow: bool,
          refused: Callable[[int, Exception], None] | None) -> Manifest | None:
    location = Location.parse(str(directory))
    current = read_manifest(location)
    upto, _ = _latest(directory, current, None, read=False)
    if upto <= current.log_position:
        return None
    if may_grow and not grown(current):
        rows = live_rows(directory, upto)
        if len(rows.ids) >= spec.grow_at:
            try:
                return grow(directory, spec, rows, backend)
            except ShardserveError as exc:
                if refused is None:
                    raise
                refused(len(rows.ids), exc)
    return compact(str(directory))


def grow(directory: str | Path, spec: CollectionSpec, rows: Rows, backend: str = "local") -> Manifest:
    """Build `rows` as `spec.index` in `spec.shards` shards, gate it, publish it (see the module)."""
    started = time.perf_counter()
    location = Location.parse(str(directory))
    current = read_manifest(location)
    factory, auto = spec.index, None
    if factory == "auto":
        factory, auto = choose_factory(len(rows.ids), spec.dim, DEFAULT_MEMORY_BUDGET)
    params = BuildParams(factory, spec.shards, spec.metric)
    if len(rows.ids) < spec.shards:
        raise ShardserveError(f"{spec.shards} shards need at least {spec.shards} rows, got {len(rows.ids)}")
    extra: dict = {"collection": spec.name, GROWN: current.index_version, "grow_at": spec.grow_at,
                   "backend": backend}

    def add(empty: bytes, partition: Partition, at: Location, timings: dict):
        rows_of_shard = rows_per_shard(partition, empty, rows.vectors)
        add_shards = add_shards_ray if backend == "ray" else add_shards_local
        entries = add_shards(rows.vectors, rows.ids, empty, rows_of_shard, at)
        entries = sorted(entries, key=lambda e: e.name)
        shards = [index_from_bytes(read_shard_checked(at, entry)) for entry in entries]
        setting, recall = gate(shards, rows.vectors, spec.metric, rows.ids)
        extra.update(recall_at_10=round(recall, 4), search_params=setting)
        if setting:  # the index's own default from now on: a search that names none gets it
            name, value = next(iter(setting.items()))
            for index in shards:
                _set_probes(index, name, value)
            entries = [write_shard(at, shard, index) for shard, index in enumerate(shards)]
        metadata = None
        if rows.metadata is not None:
            metadata = [write_metadata(at, shard, rows.ids[mine], rows.metadata.take(pa.array(mine)))
                        for shard, mine in enumerate(rows_of_shard)]
        return entries, metadata

    def finish_trained(empty: bytes) -> bytes:  # the deltas' copies search as the shards do
        setting = extra.get("search_params")
        if not setting:
            return empty
        index = index_from_bytes(empty)
        _set_probes(index, *next(iter(setting.items())))
        return index_to_bytes(index)

    return publish_build(location, params, current.dataset, spec.dim, len(rows.ids),
                         lambda: training_sample(rows.vectors, params), add, extra, auto,
                         log_position=rows.position, started=started, finish_trained=finish_trained)


def gate(shards: list[faiss.Index], vectors: np.ndarray, metric: str,
         ids: np.ndarray | None = None) -> tuple[dict[str, int], float]:
    """The smallest search setting (from FIRST_PROBES up, doubling) at which `shards` answer
    GATE_QUERIES of `vectors` (seeded) with recall@10 >= RECALL_TARGET against the exact neighbours
    among `vectors` (stored under `ids`, default their positions); ({}, recall) for an index
    without one. ShardserveError below the target at
    every setting: nothing is published."""
    rng = np.random.default_rng(7)
    queries = vectors[rng.choice(len(vectors), min(GATE_QUERIES, len(vectors)), replace=False)]
    k = min(GATE_K, len(vectors))
    exact = faiss.IndexFlatL2(vectors.shape[1]) if metric == "l2" else faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    exact_distances, truth = exact.search(queries, k)
    if ids is not None:
        truth = ids[truth]
    # a found point as near as the k-th exact neighbour is one (a tie, e.g. duplicate vectors)
    kth = exact_distances[:, -1:]
    name, limit = _probes(shards[0])
    higher = metric != "l2"
    value = min(FIRST_PROBES.get(name, 1), limit) if name else 0
    while True:
        if name:
            for index in shards:
                _set_probes(index, name, value)
        answers = [index.search(queries, k) for index in shards]
        distances, found = merge_topk([a[0] for a in answers], [a[1] for a in answers], k, higher)
        tolerance = 1e-5 * np.maximum(np.abs(kth), 1.0)
        as_near = (distances >= kth - tolerance) if higher else (distances <= kth + tolerance)
        hits = [min(k, len(set(f) & set(t)) + int(((~np.isin(f, t)) & near & (f >= 0)).sum()))
                for f, t, near in zip(found, truth, as_near, strict=True)]
        recall = float(np.mean(hits)) / k
        if recall >= RECALL_TARGET:
            return ({name: value} if name else {}), recall
        if not name or value >= limit:
            raise ShardserveError(f"the grown index reaches recall@{k} {recall:.3f} at best, under "
                                  f"{RECALL_TARGET}: not published (the exact version keeps serving)")
        value = min(2 * value, limit)


def _probes(index: faiss.Index) -> tuple[str | None, int]:
    """The search setting `index` takes (nprobe up to its lists, efSearch up to 1024), if any."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return "nprobe", int(ivf.nlist)
    if isinstance(unwrap_id_map(index), faiss.IndexHNSW):
        return "efSearch", 1024
    return None, 0


def _set_probes(index: faiss.Index, name: str, value: int) -> None:
    ivf = faiss.try_extract_index_ivf(index)
    if name == "nprobe" and ivf is not None:
        ivf.nprobe = value
    elif name == "efSearch":
        unwrap_id_map(index).hnsw.efSearch = value  # type: ignore[attr-defined]


FOLD_LOCK = "fold.lock"


def _fold_lock(directory: str | Path) -> contextlib.AbstractContextManager[bool]:
    """The collection's fold lock (shardserve.collection.catalogue.file_lock): yields whether it
    was taken. Held, no other fold of it runs, so a version directory without a manifest is what
    a fold killed midway left."""
    return file_lock(Path(directory) / FOLD_LOCK, wait=False)


def _sweep_unpublished(location: Location) -> list[str]:
    """Delete what folds killed midway left: version directories with no manifest (a version's
    manifest is written last, before it is published)."""
    versions = location.child(VERSIONS_DIR)
    gone = []
    for info in versions.fs.get_file_info(pafs.FileSelector(versions.root, allow_not_found=True)):
        folder = versions.child(info.base_name)
        if info.type == pafs.FileType.Directory and not folder.exists(MANIFEST):
            folder.delete_dir()
            gone.append(info.base_name)
    return gone


def _latest(directory: str | Path, current: Manifest, upto: int | None, read: bool = True):
    """(the log position folded up to, each id's last operation after the version's position)."""
    path = log_address(str(directory))
    if path is None or not log_exists(path):
        return current.log_position, {}
    log = open_log(path, readonly=True)
    try:
        last = log.last_position() if upto is None else upto
        return last, (latest_ops(log, current.log_position, last) if read and last > current.log_position
                      else {})
    finally:
        log.close()
