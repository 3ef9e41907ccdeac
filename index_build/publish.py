"""What every build shares, in memory or streamed: the parameters that decide the bytes, the
training sample, shard files written and read back, and the one way a version is published.

Every build writes into its own `versions/<build id>/` (shard files and that version's manifest) and
publishes it by replacing the index directory's manifest.json in one atomic write. A published
version is never changed again: `--force` builds beside the old version, which keeps serving (and
stays on disk for the replicas still bound to it) if the rebuild fails.

The write log belongs to the index directory, not to a version (shardserve.writes.locate): a build
into a directory that took writes either starts its version at the log's last position, leaving
every write so far out of it by request (`discard_writes`), or is refused (`writes_start`). A version
at position 0 over such a log would replay old writes onto other data, or, once compaction truncated
the log, never start (its shards' LogGap).
"""

from __future__ import annotations

import datetime as dt
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import faiss
import numpy as np

from shardserve.errors import ShardserveError
from shardserve.index.indexes import index_to_bytes, make_empty_index, train_empty_index
from shardserve.index.manifest import (
    VERSIONS_DIR,
    BuildInfo,
    DatasetInfo,
    Manifest,
    MetadataEntry,
    ModelIdentity,
    ShardEntry,
    published,
    write_manifest,
)
from shardserve.index.partition import Partition
from shardserve.index.storage import Location, sha256_hex
from shardserve.runtime.timing import timed
from shardserve.writes.locate import log_address, log_exists, open_log


@dataclass(frozen=True)
class BuildParams:
    """What determines the shard bytes: same params + same data → byte-identical shards.

    factory: any FAISS index_factory string (Flat, IVF1024,Flat, IVF256,PQ16x4fs, HNSW32, ...).
    shards: number of shards S; plain IVF indexes deal whole lists to shards, others row i to
        shard i mod S (shardserve.index.partition).
    metric: l2, ip or cosine (cosine L2-normalises base and queries).
    train_size: rows sampled (seeded) to train the quantizer; 0 = min(n, 256 x nlist or 100K).
    seed: sampling and k-means seed.
    """

    factory: str
    shards: int
    metric: str
    train_size: int = 0
    seed: int = 1234


TrainSample = Callable[[], np.ndarray]
AddShards = Callable[[bytes, Partition, Location, dict],
                    tuple[list[ShardEntry], list[MetadataEntry] | None]]


def publish_build(location: Location, params: BuildParams, dataset: DatasetInfo, dim: int, num_vectors: int,
                  sample: TrainSample, add: AddShards, extra: dict, auto: str | None = None,
                  discard_writes: bool = False, embedder: ModelIdentity | None = None,
                  version_id: str | None = None, started: float | None = None,
                  log_position: int | None = None,
                  finish_trained: Callable[[bytes], bytes] | None = None) -> Manifest:
    """What every build shares: its own version directory, train ONCE, `add` the shards (and their
    metadata), the trained file, the version's manifest, then publish with one atomic replace of
    manifest.json. A failure deletes this build's directory and leaves the published version as it was.
    The version's log position is read just before it is published (`writes_start`): a write that
    arrives during the build is refused with the build, or left out with the others.

    `embedder`: the model the vectors were embedded with (a build from text): the manifest records
    it and the index version covers it. `version_id`: the version directory's name, when the caller
    chose it before (`new_version_id`; a build from text keeps its embedded vectors under the same
    name). `started`: when the build began (time.perf_counter()), when before this call.
    `log_position`: the log position the shards include (a collection grown from its own rows and
    log, index_build.grow), instead of the log's start (`writes_start`). `finish_trained`: what the
    trained file holds, from the trained empty index, once the shards are added (a grown
    collection's carries the search setting its gate chose, as its shards do)."""
    timings: dict[str, float] = {}
    started = time.perf_counter() if started is None else started
    created = dt.datetime.now(dt.UTC)
    version_dir = f"{VERSIONS_DIR}/{version_id or new_version_id(created)}"
    index_location, location = location, location.child(version_dir)
    try:
        location.fs.create_dir(location.root, recursive=True)
        with timed("train", timings):
            train = sample()
            empty = train_empty_index(params.factory, params.metric, train, params.seed)
        with timed("partition", timings):
            partition = Partition.plan(empty, train, params.shards)
        del train
        entries, metadata = add(empty, partition, location, timings)
        entries = sorted(entries, key=lambda e: e.name)
        trained = write_file(location, TRAINED_FILE, finish_trained(empty) if finish_trained else empty, 0)
        if log_position is None:
            log_position = writes_start(index_location, discard_writes)
        elif discard_writes:
            raise ShardserveError("a build at a given log position discards no writes")
        if log_position and discard_writes:
            extra = {**extra, "discarded_writes_to": log_position}
        manifest = Manifest(
            index_version=Manifest.content_version(entries, params.factory, params.metric, metadata,
                                                   log_position, embedder),
            dim=dim, metric=params.metric, index_factory=params.factory, num_vectors=num_vectors,
            shards=entries, trained=trained, metadata=metadata, dataset=dataset,
            build=BuildInfo(params={**_public(params), **extra, "partition": partition.describe(),
                                    "stages_s": timings,
                                    **({"auto": auto} if auto else {})},
                            seconds=round(time.perf_counter() - started, 3),
                            ray_version=_ray_version(), faiss_version=faiss.__version__),
            created_at=created.isoformat(timespec="seconds"), log_position=log_position, embedder=embedder,
        )
        write_manifest(location, manifest)  # the version's own manifest: what deployments bind to
        # Published only now, after every shard was checked: one atomic replace of manifest.json.
        write_manifest(index_location, published(manifest, version_dir))
    except BaseException:
        location.delete_dir()  # only this build's directory: the published version is untouched
        index_location.child(VERSIONS_DIR).delete_dir(only_if_empty=True)
        raise
    return published(manifest, version_dir)


def new_version_id(created: dt.datetime | None = None) -> str:
    """A version directory's name: its build's start time (UTC) and 8 random hex digits."""
    created = created or dt.datetime.now(dt.UTC)
    return f"{created:%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"


def writes_start(location: Location, discard_writes: bool) -> int:
    """The log position a new build of the index at `location` starts at: 0 when its write log (the
    SQLite file in the directory, or its Redis stream: shardserve.writes.locate) never took a write;
    the log's last position when `discard_writes` says to leave every write so far out of the new
    version (its shards then apply only what comes after); otherwise a ShardserveError, in one line:
    a build from the dataset would drop those writes, whether the log still holds them or a
    compacted version does."""
    address = log_address(location.uri)
    if not log_exists(address):
        return 0
    assert address is not None
    log = open_log(address, readonly=True)
    try:
        last, first = log.last_position(), log.first_position()
    finally:
        log.close()
    if last == 0 or discard_writes:
        return last
    held = 0 if first is None else last - first + 1
    raise ShardserveError(f"{location.uri} took writes (its write log is at request {last}, {held} still "
                          "in the log, the rest in compacted versions): a build from the dataset leaves "
                          "them out; pass --discard-writes to build it anyway, starting at that position")


def training_sample(vectors: np.ndarray, params: BuildParams) -> np.ndarray:
    """A seeded, sorted row sample: deterministic for the same data and params."""
    rows = training_rows(params.factory, vectors.shape[1], params.metric, len(vectors), params.train_size,
                         params.seed)
    return vectors if rows is None else vectors[rows]


def training_rows(factory: str, dim: int, metric: str, base_rows: int, train_size: int, seed: int,
                  max_bytes: int | None = None) -> np.ndarray | None:
    """Sorted base rows to train on (None: all of them). `train_size` 0 = what the factory needs
    (256 x nlist for IVF, else 100K), capped at `max_bytes` of float32 when given."""
    size = train_size
    if size <= 0:
        ivf = faiss.try_extract_index_ivf(make_empty_index(factory, dim, metric))
        size = 256 * ivf.nlist if ivf is not None else 100_000
    if max_bytes is not None:
        size = min(size, max(1, max_bytes // (4 * dim)))
    if size >= base_rows:
        return None
    return np.sort(np.random.default_rng(seed).choice(base_rows, size, replace=False))


def shard_file_name(shard: int) -> str:
    return f"shard-{shard:03d}.faiss"


TRAINED_FILE = "trained.faiss"


def write_shard(location: Location, shard: int, index: faiss.Index) -> ShardEntry:
    """Write one shard file, read it back and return its manifest entry (sha256 of what is stored)."""
    return write_file(location, shard_file_name(shard), index_to_bytes(index), int(index.ntotal))


def write_file(location: Location, name: str, data: bytes, num_vectors: int) -> ShardEntry:
    """Write an index file, read it back, and return its manifest entry (sha256 of what is stored)."""
    location.write_bytes(name, data)
    stored = location.read_bytes(name)
    if stored != data:
        raise ShardserveError(f"shard {name}: read-back differs from what was written")
    return ShardEntry(name=name.removesuffix(".faiss"), path=name, num_vectors=num_vectors,
                      sha256=sha256_hex(data), bytes=len(data))


def _public(params: BuildParams) -> dict:
    return {"factory": params.factory, "shards": params.shards, "metric": params.metric,
            "train_size": params.train_size, "seed": params.seed}


def _ray_version() -> str:
    try:
        import ray

        return ray.__version__
    except ImportError:
        return "none"
