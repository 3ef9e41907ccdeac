"""`shardserve compact INDEX`: fold the write log into a new immutable index version.

The published version's shards, minus every id the log touched since its `log_position`, plus each
id's latest upsert in the shard its id hashes to (shardserve.writes.route: where the served deltas
hold it), with metadata to match. The result is published like a build (its own `versions/<id>/`,
then one atomic replace of manifest.json) with `log_position` = the last request folded in, so a
shard replica of it applies only what the log received afterwards: no write arriving during the
compaction is lost, and none is applied twice.

Why this is exact: an IVF shard gets each point with `add_with_ids`, which places it in its nearest
list with the same quantizer and codes the served delta used (a copy of the trained empty index),
and a flat shard stores vectors as they are: a search after the swap answers what it answered
before it, at the same log position (tests/test_compact.py). Every other kind that takes writes
(refined IVF-PQ, pre-transformed IVF, HNSW, flat codes) is rewritten by shardserve.index.removal:
the points nobody wrote keep their stored codes, each upsert gets the codes the trained index gives
it, and the version answers as that kind answers over those points (tests/test_compact_kinds.py).

The swap (`shardserve swap INDEX --address ...`) then moves a running server onto it with its
recall gate. The log is truncated only below the oldest version still on disk (`truncate_log`):
any version there may be served again (`swap --rollback`, a restart pinned to it) and needs the
requests past its own position. Deleting an old version's directory lets the next compaction
truncate further.
"""

from __future__ import annotations

import datetime as dt
import posixpath
import secrets
import time

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from index_build.publish import TRAINED_FILE, write_file, write_shard
from shardserve.errors import ShardserveError
from shardserve.index.indexes import index_from_bytes
from shardserve.index.manifest import (
    EMBEDDED_DIR,
    MANIFEST,
    VERSIONS_DIR,
    BuildInfo,
    Manifest,
    MetadataEntry,
    published,
    read_manifest,
    read_shard_checked,
    write_manifest,
)
from shardserve.index.metadata import MetadataTable, write_metadata
from shardserve.index.partition import Partition
from shardserve.index.removal import remove_ids
from shardserve.index.storage import Location
from shardserve.writes.locate import Log, log_address, log_exists, open_log
from shardserve.writes.ops import Op, Upsert
from shardserve.writes.route import WriteRoute


def latest_ops(log: Log, after: int, upto: int) -> dict[int, Op]:
    """Each id's last operation among the log's requests (after, upto]."""
    latest: dict[int, Op] = {}
    position = after
    while position < upto:
        requests = log.read(position, 64)  # up to 1,000 points each: a bounded read
        if not requests or requests[0][0] != position + 1:
            raise ShardserveError(f"the write log no longer holds request {position + 1}: this version "
                                  "cannot be compacted (a newer one already folded it)")
        for number, ops in requests:
            if number > upto:
                return latest
            for op in ops:
                latest[op.id] = op
            position = number
    return latest


def compact(index: str) -> Manifest:
    """Publish a new version of `index` with its log folded in; return its (published) manifest.
    Refused, changing nothing, when there is nothing to fold."""
    started, location = time.perf_counter(), Location.parse(index)
    current = read_manifest(location)
    path = log_address(index)
    if path is None or not log_exists(path):
        raise ShardserveError(f"{index}: no write log (nothing was ever written): nothing to compact")
    log = open_log(path, readonly=True)
    try:
        upto = log.last_position()
        if upto <= current.log_position:
            raise ShardserveError(f"{index}: version {current.index_version} already includes the whole "
                                  f"log (position {upto}): nothing to compact")
        latest = latest_ops(log, current.log_position, upto)
    finally:
        log.close()
    touched = np.array(sorted(latest), np.int64)
    upserts = [op for op in latest.values() if isinstance(op, Upsert)]
    ids = np.array([op.id for op in upserts], np.int64)
    vectors = (np.stack([op.vector for op in upserts]) if upserts
               else np.zeros((0, current.dim), np.float32))
    home = WriteRoute(Partition(len(current.shards))).shard_of(ids, vectors) if upserts else ids
    created = dt.datetime.now(dt.UTC)
    version_dir = f"{VERSIONS_DIR}/{created:%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"
    target = location.child(version_dir)
    try:
        target.fs.create_dir(target.root, recursive=True)
        entries, metadata = [], []
        for shard, entry in enumerate(current.shards):
            mine = np.flatnonzero(home == shard)
            index_ = _folded(index_from_bytes(read_shard_checked(location, entry)), touched,
                             ids[mine], vectors[mine])
            entries.append(write_shard(target, shard, index_))
            if current.metadata is not None:
                metadata.append(_folded_metadata(location, current.metadata[shard], target, shard,
                                                 touched, [upserts[i] for i in mine.tolist()]))
        trained = (write_file(target, TRAINED_FILE, read_shard_checked(location, current.trained), 0)
                   if current.trained else None)
        meta = metadata or None
        manifest = Manifest(
            index_version=Manifest.content_version(entries, current.index_factory, current.metric, meta,
                                                   embedder=current.embedder),
            dim=current.dim, metric=current.metric, index_factory=current.index_factory,
            num_vectors=sum(e.num_vectors for e in entries), shards=entries, trained=trained,
            metadata=meta, log_position=upto, dataset=current.dataset, embedder=current.embedder,
            build=BuildInfo(params={**current.build.params, "compacted_from": current.index_version,
                                    "dataset_rows": _dataset_rows(current),
                                    "log_from": current.log_position, "log_position": upto},
                            seconds=round(time.perf_counter() - started, 3),
                            ray_version=current.build.ray_version, faiss_version=faiss.__version__),
            created_at=created.isoformat(timespec="seconds"))
        write_manifest(target, manifest)
        write_manifest(location, published(manifest, version_dir))
    except BaseException:
        target.delete_dir()  # only this compaction's directory: the published version is untouched
        raise
    truncate_log(index)
    return published(manifest, version_dir)


def truncate_log(index: str) -> int:
    """Forget the log's requests that every version on disk already includes; return the first
    position kept."""
    location = Location.parse(index)
    versions = location.child(VERSIONS_DIR)
    kept = [info.base_name for info in versions.fs.get_file_info(pafs.FileSelector(versions.root))
            if info.type == pafs.FileType.Directory]
    oldest = min((read_manifest(versions.child(name)).log_position for name in kept
                  if versions.child(name).exists(MANIFEST)), default=0)
    path = log_address(index)
    if path is not None and oldest > 0 and log_exists(path):
        log = open_log(path)
        try:
            log.truncate_below(oldest + 1)
        finally:
            log.close()
    return oldest + 1


def prune_versions(index: str, keep: set[str]) -> list[str]:
    """Delete the complete versions under `versions/` whose index_version is not in `keep`, then
    truncate the log below what the kept ones include; the directories deleted. A directory
    without a manifest (a compaction or build in progress) is left alone. A build from text's
    embedded vectors (`embedded/<build id>/`) go once no version left refers to them."""
    location = Location.parse(index)
    versions = location.child(VERSIONS_DIR)
    gone = []
    for info in versions.fs.get_file_info(pafs.FileSelector(versions.root)):
        folder = versions.child(info.base_name)
        if (info.type == pafs.FileType.Directory and folder.exists(MANIFEST)
                and read_manifest(folder).index_version not in keep):
            folder.delete_dir()
            gone.append(info.base_name)
    _prune_embedded(location)
    truncate_log(index)
    return sorted(gone)


def _prune_embedded(location: Location) -> None:
    """Delete each `embedded/<build id>/` that no manifest on disk names as its dataset and whose
    build is not in progress (its `versions/<build id>/` gone: a build from text makes that directory
    before it embeds, index_build.embed_corpus)."""
    embedded = location.child(EMBEDDED_DIR)
    folders = [info.base_name for info in embedded.fs.get_file_info(
        pafs.FileSelector(embedded.root, allow_not_found=True)) if info.type == pafs.FileType.Directory]
    if not folders:
        return
    versions = location.child(VERSIONS_DIR)
    present = {info.base_name for info in versions.fs.get_file_info(
        pafs.FileSelector(versions.root, allow_not_found=True)) if info.type == pafs.FileType.Directory}
    manifests = [read_manifest(versions.child(name)) for name in present
                 if versions.child(name).exists(MANIFEST)]
    if location.exists(MANIFEST):
        manifests.append(read_manifest(location))
    named = {posixpath.basename(m.dataset.name.partition("?")[0].rstrip("/")) for m in manifests
             if m.dataset.text_column is not None}
    for name in folders:
        if name not in named and name not in present:
            embedded.child(name).delete_dir()
    embedded.delete_dir(only_if_empty=True)


def _dataset_rows(manifest: Manifest) -> int:
    """The rows of the data the version's lineage was built from: the swap's gate loads its eval queries
    from it (and its truth too, for a version whose shards keep codes instead of the vectors)."""
    return int(manifest.build.params.get("dataset_rows", manifest.num_vectors))


def _folded(index: faiss.Index, touched: np.ndarray, ids: np.ndarray, vectors: np.ndarray) -> faiss.Index:
    """One shard's index minus the touched ids plus its upserts (a writable, in-memory copy). Every
    kind that takes writes is rewritten here (shardserve.index.removal); any other is refused,
    naming it, before anything is published."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and ivf.direct_map.type != faiss.DirectMap.NoMap:  # type: ignore[attr-defined]
        ivf.set_direct_map_type(faiss.DirectMap.NoMap)  # type: ignore[attr-defined]  # rebuilt on load
    if len(touched):
        remove_ids(index, touched)
    if len(ids):
        index.add_with_ids(np.ascontiguousarray(vectors, np.float32), ids)
    return index


def _folded_metadata(location: Location, entry: MetadataEntry, target: Location, shard: int,
                     touched: np.ndarray, upserts: list[Upsert]) -> MetadataEntry:
    """One shard's metadata: its rows not touched, plus its upserts' (a missing column is null)."""
    table = MetadataTable.load(location, entry)
    keep = np.flatnonzero(~np.isin(table.ids, touched))
    kept = table.table.take(pa.array(keep))
    added = pa.Table.from_pylist([op.metadata or {} for op in upserts], schema=kept.schema)
    ids = np.concatenate([table.ids[keep], np.array([op.id for op in upserts], np.int64)])
    return write_metadata(target, shard, ids, pa.concat_tables([kept, added]))
