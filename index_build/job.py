"""`shardserve build`: train once, add per shard in parallel (Ray Data), publish shards + manifest.

In memory (every dataset but parquet): load → sample (seeded) → train the empty index ONCE → deal
rows to shards (whole IVF lists per shard, else i mod S: shardserve.index.partition) → one Ray Data task per
shard adds its rows from the matrix in the object store and writes its shard file → the manifest
is written last, atomically (index_build.publish). Parquet is
streamed instead (index_build.streaming), with the same rows, rules and bytes.
"""

from __future__ import annotations

import logging
from typing import Literal

import faiss
import numpy as np

from index_build.publish import (
    BuildParams,
    publish_build,
    training_sample,
    write_shard,
    writes_start,
)
from shardserve.data.datasets import BASE_ONLY_METRIC, Dataset, is_npy_dir_spec, is_parquet_spec, load_dataset
from shardserve.errors import ShardserveError
from shardserve.index.auto_index import DEFAULT_MEMORY_BUDGET, choose_factory
from shardserve.index.indexes import add_to_copy, make_empty_index, prepare_vectors
from shardserve.index.manifest import MANIFEST, DatasetInfo, Manifest, MetadataEntry, ShardEntry
from shardserve.index.metadata import column_kinds, write_metadata
from shardserve.index.partition import BY_LISTS, Partition, assigner_of
from shardserve.index.storage import Location
from shardserve.runtime.timing import timed

log = logging.getLogger(__name__)
Backend = Literal["ray", "local"]


def build_index(dataset_spec: str, shards: int, factory: str, out: str, metric: str | None = None,
                limit: int | None = None, backend: Backend = "ray", force: bool = False,
                train_size: int = 0, seed: int = 1234, vector_column: str | None = None,
                id_column: str | None = None, metadata_columns: list[str] | None = None,
                memory_budget: int = DEFAULT_MEMORY_BUDGET, discard_writes: bool = False,
                text_column: str | None = None, embedder: str | None = None) -> Manifest:
    """Build a sharded index of `dataset_spec` at `out`; return its manifest (published last, atomically).

    Arguments:
        dataset_spec: a dataset name (`fashion-mnist`, `synthetic:NxD`, `glove-50`), a vector file, or a
            directory, glob or pyarrow URI of parquet or `.npy` files (those are streamed).
        shards: how many shard files (and Serve deployments) the index has.
        factory: a FAISS factory string, or "auto" to pick one from the data's size and `memory_budget`
            (shardserve.index.auto_index).
        out: a local path or pyarrow URI; each build publishes a new version directory under it.
        metric: "l2", "ip" or "cosine" (default: the dataset's).
        limit: index only the first `limit` rows.
        backend: "ray" (the Ray Data job) or "local" (one process; the same bytes).
        force: publish a new version over an existing index.
        discard_writes: build into a directory whose write log took writes, leaving them out: the
            version starts at the log's last position (index_build.publish.writes_start); without it
            such a build is refused before any work.
        train_size: training sample rows (0: the factory's need, capped).
        seed: the training sample's and k-means' seed (same data + params -> same bytes).
        vector_column, id_column, metadata_columns: parquet columns of the vectors, of the user's
            int64 ids, and of the metadata stored per shard.
        memory_budget: bytes the index may take, for `factory="auto"`.
        text_column, embedder: build from text (index_build.embed_corpus): `dataset_spec` is then a
            corpus of parquet, JSON lines or .txt files, `text_column` its texts' column (a .txt
            file's is `text`), and `embedder` the model that embeds them (a known name or a model
            folder: shardserve.embed.model_files); the metric is cosine.
    """
    if shards < 1:
        raise ShardserveError(f"--shards must be >= 1, got {shards}")
    _check_text_flags(dataset_spec, text_column, embedder, metric, vector_column)
    location = Location.parse(out)
    location.ensure_writable()
    if location.exists(MANIFEST) and not force:
        raise ShardserveError(f"{out} already holds an index (manifest.json); pass --force to replace it")
    writes_start(location, discard_writes)  # refused here, before any work, if it took writes

    def factory_for(rows: int, dim: int) -> tuple[str, str | None]:
        if factory != "auto":
            return factory, None
        chosen, reason = choose_factory(rows, dim, memory_budget)
        log.info("--index auto: %s (%s)", chosen, reason)
        return chosen, reason

    if embedder is not None:  # from text: embedded into parquet files, then streamed like them
        from index_build.embed_corpus import build_text_index

        return build_text_index(dataset_spec, text_column=text_column, model=embedder,
                                params=BuildParams(factory, shards, "cosine", train_size, seed),
                                location=location, backend=backend, id_column=id_column,
                                metadata_columns=metadata_columns, limit=limit, factory_for=factory_for,
                                discard_writes=discard_writes)
    if is_parquet_spec(dataset_spec) or is_npy_dir_spec(dataset_spec):  # streamed: no process holds the base
        from index_build.streaming import build_streaming

        params = BuildParams(factory, shards, metric or BASE_ONLY_METRIC, train_size, seed)
        return build_streaming(dataset_spec, params=params, location=location, backend=backend,
                               vector_column=vector_column, id_column=id_column,
                               metadata_columns=metadata_columns, limit=limit, factory_for=factory_for,
                               discard_writes=discard_writes)
    dataset = load_dataset(dataset_spec, limit=limit, vector_column=vector_column, id_column=id_column,
                           metadata_columns=metadata_columns)
    auto = None
    if factory == "auto":
        factory, auto = choose_factory(len(dataset.base), dataset.dim, memory_budget)
        log.info("--index auto: %s (%s)", factory, auto)
    params = BuildParams(factory, shards, metric or dataset.metric, train_size, seed)
    make_empty_index(factory, dataset.dim, params.metric)  # fail on a bad factory before any work
    if len(dataset.base) < shards:
        raise ShardserveError(f"{shards} shards need at least {shards} vectors, got {len(dataset.base)}")
    if backend == "ray":
        from shardserve.runtime.ray_session import ensure_ray

        ensure_ray(serving_node=False)
    return build_from_dataset(dataset, params, location, backend, vector_column, id_column, auto,
                              discard_writes)


def _check_text_flags(dataset_spec: str, text_column: str | None, embedder: str | None, metric: str | None,
                      vector_column: str | None) -> None:
    """A build from text takes --embedder and --text-column together (a .txt corpus's column is
    implied), no vector column, and no metric but cosine (the model's)."""
    if text_column is not None and embedder is None:
        raise ShardserveError("--text-column needs --embedder: the model that turns the texts into vectors "
                              "(e.g. --embedder all-MiniLM-L6-v2)")
    if embedder is None:
        return
    if text_column is None and not _txt_only(dataset_spec):
        raise ShardserveError("--embedder needs --text-column: the column of the dataset holding the texts "
                              "(a .txt dataset's is `text`, one a line)")
    if vector_column is not None:
        raise ShardserveError("--vector-column: a build with --embedder makes its vectors from --text-column")
    if metric not in (None, "cosine"):
        raise ShardserveError(f"--metric {metric}: an index built with --embedder is searched by cosine "
                              "similarity, the model's metric")


def _txt_only(spec: str) -> bool:
    """A directory or glob whose files are .txt (the corpus's own check says more when not)."""
    from shardserve.data.text import corpus_files

    try:
        return corpus_files(spec)[1] == "text"
    except ShardserveError:
        return False


def build_from_dataset(dataset: Dataset, params: BuildParams, location: Location,
                       backend: Backend = "ray", vector_column: str | None = None,
                       id_column: str | None = None, auto: str | None = None,
                       discard_writes: bool = False) -> Manifest:
    """The in-memory build: `dataset` holds the base matrix; Ray (or this process) adds per shard."""
    vectors = prepare_vectors(dataset.base, params.metric)

    def add(empty: bytes, partition: Partition, at: Location,
            timings: dict) -> tuple[list[ShardEntry], list[MetadataEntry] | None]:
        with timed("deal rows to shards", timings):
            rows_of_shard = rows_per_shard(partition, empty, vectors)
        with timed(f"add+write {params.shards} shards ({backend})", timings):
            add_shards = add_shards_ray if backend == "ray" else add_shards_local
            entries = add_shards(vectors, dataset.index_ids(), empty, rows_of_shard, at)
        metadata = None
        if dataset.metadata is not None:  # the same rows as each shard's index
            with timed("metadata", timings):
                ids = dataset.index_ids()
                metadata = [write_metadata(at, s, ids[rows], dataset.metadata.take(rows))
                            for s, rows in enumerate(rows_of_shard)]
        return entries, metadata

    info = DatasetInfo(name=dataset.name, fingerprint=dataset.fingerprint(), vector_column=vector_column,
                       id_column=id_column, metadata_columns=[] if dataset.metadata is None
                       else dataset.metadata.column_names,
                       metadata_kinds={} if dataset.metadata is None
                       else column_kinds(dataset.metadata.schema))
    return publish_build(location, params, info, dataset.dim, len(vectors),
                         lambda: training_sample(vectors, params), add, {"backend": backend}, auto,
                         discard_writes)


def rows_per_shard(partition: Partition, empty: bytes, vectors: np.ndarray) -> list[np.ndarray]:
    """Each shard's base rows, ascending (the order they are added in: deterministic bytes)."""
    assigner = assigner_of(empty) if partition.kind == BY_LISTS else None
    shard_of = partition.shard_of(np.arange(len(vectors)), vectors, assigner)
    return [np.flatnonzero(shard_of == s) for s in range(partition.shards)]


def add_shards_local(vectors: np.ndarray, ids: np.ndarray, empty: bytes, rows_of_shard: list[np.ndarray],
                     location: Location) -> list[ShardEntry]:
    """Single-process reference: the same adds, one shard after another, all cores per add.
    Row i (id `ids[i]`: the user's, or i) goes to the shard whose rows hold it."""
    return [write_shard(location, s, add_to_copy(empty, vectors[rows], ids[rows]))
            for s, rows in enumerate(rows_of_shard)]


def add_shards_ray(vectors: np.ndarray, ids: np.ndarray, empty: bytes, rows_of_shard: list[np.ndarray],
                   location: Location) -> list[ShardEntry]:
    """Ray Data over shard specs: one task per shard adds its rows and writes its file.

    The base matrix and the trained index go into the object store once; each task maps them
    zero-copy and selects its rows, so no shuffle moves the data (a groupby(shard) hash shuffle
    costs more than the adds themselves).
    """
    import ray

    shards = len(rows_of_shard)
    specs = ray.data.from_items([{"shard": s} for s in range(shards)], override_num_blocks=shards)
    written = specs.map_batches(  # fn_kwargs fill the task's other parameters
        _add_and_write_shard,  # type: ignore[arg-type]
        batch_size=1, batch_format="numpy", num_cpus=1,
        fn_kwargs={"refs": [ray.put(vectors), ray.put(ids), ray.put(empty), ray.put(rows_of_shard)],
                   "location_uri": location.uri})
    rows = written.take_all()
    if len(rows) != shards:
        raise ShardserveError(f"Ray build wrote {len(rows)} of {shards} shards")
    return [ShardEntry.model_validate_json(row["entry"]) for row in rows]


def _add_and_write_shard(batch: dict[str, np.ndarray], refs: list,
                         location_uri: str) -> dict[str, np.ndarray]:
    """Ray Data task body: this shard's rows of the shared matrix, with their ids → one shard file."""
    import ray

    faiss.omp_set_num_threads(1)  # one CPU per task; also makes HNSW insertion order deterministic
    vectors, ids, empty, rows_of_shard = ray.get(refs)
    entries = []
    for shard in batch["shard"].tolist():
        rows = rows_of_shard[shard]
        index = add_to_copy(empty, np.ascontiguousarray(vectors[rows]), np.ascontiguousarray(ids[rows]))
        entries.append(write_shard(Location.parse(location_uri), shard, index).model_dump_json())
    return {"entry": np.array(entries)}
