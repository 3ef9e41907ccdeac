"""The streaming build for parquet data bigger than one process: no process ever holds the base set.

Sources: parquet files (ParquetSource: every read is one row group, through pyarrow, with only the
asked columns) and directories of .npy files (NpySource: memory-mapped, read in chunks).
Stages:
1. one sequential pass in the driver: check every row group (dimension, NaN/Inf, ids), hash the data
   into the same content fingerprint the in-memory reader gives, keep the training sample and the
   ids (8 bytes a row: the duplicate check needs them all; the vectors are never kept);
2. train the empty index ONCE on that bounded sample;
3. Ray Data over shard specs: each task streams the row groups again and adds only its own rows
   (the rows of the IVF lists it owns, else base row i mod S: shardserve.index.partition, as in the in-memory
   build), then writes its shard file and its metadata file. Memory per task: one row group plus
   the shard it builds. Dealing by list costs each task a coarse assignment of every row (S
   assignments of the data in all, where the adds alone do one).

Row numbers, the held-out queries, the training rows and the row -> shard rule are those of the
in-memory path (shardserve.data.datasets, index_build.job), so both builds of the same files write
byte-identical shards and the same index version (tested). The cost of this simple design: every
shard task reads the whole dataset (S reads; from the page cache after the first). Adding per
(row group, shard) partial indexes and merging them per shard (`merge_from`) would spread the adds
over more tasks than shards; it is not built: FAISS 1.15 has no merge for IndexRefine or HNSW, and a
merged fast-scan IVF differs in bytes from the same rows added in order (README says more).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardserve.data.datasets import (
    BASE_ONLY_METRIC,
    VectorRows,
    as_float32,
    check_ids,
    check_same_dim,
    dataset_name,
    is_npy_dir_spec,
    npy_files,
    open_npy,
    parquet_arrays,
    parquet_columns,
    parquet_files,
    self_query_rows,
)
from shardserve.errors import ShardserveError
from shardserve.index.indexes import make_empty_index, prepare_vectors
from shardserve.index.manifest import Manifest, MetadataEntry, ModelIdentity
from shardserve.index.metadata import write_metadata
from shardserve.index.partition import BY_LISTS, Partition, assigner_of
from shardserve.index.storage import Location

TRAIN_MAX_BYTES = 256 * 2**20  # the training sample's cap, whatever the factory asks for


@dataclass(frozen=True)
class ParquetSource:
    """Parquet files read row group by row group, with the in-memory reader's column rules."""

    name: str
    files: tuple[str, ...]
    columns: tuple[str, ...]  # vector column first
    id_column: str | None
    metadata_columns: tuple[str, ...]
    row_groups: tuple[tuple[int, int, int], ...]  # (file number, row group, rows)

    @classmethod
    def open(cls, spec: str, vector_column: str | None, id_column: str | None,
             metadata_columns: list[str] | None) -> ParquetSource:
        import pyarrow.parquet as pq

        files = parquet_files(spec)
        columns = [parquet_columns(path, vector_column, id_column, metadata_columns) for path in files]
        if len({tuple(c) for c in columns}) != 1:
            raise ShardserveError(f"{spec}: files differ in their columns "
                                  f"({sorted({', '.join(c) for c in columns})})")
        groups = []
        for number, path in enumerate(files):
            meta = pq.ParquetFile(path).metadata
            groups += [(number, group, meta.row_group(group).num_rows) for group in range(meta.num_row_groups)
                       if meta.row_group(group).num_rows]
        return cls(dataset_name(spec), tuple(files), tuple(columns[0]), id_column,
                   tuple(metadata_columns or ()), tuple(groups))

    @property
    def rows(self) -> int:
        return sum(rows for _, _, rows in self.row_groups)

    def read(self, metadata: bool = True) -> Iterator[VectorRows]:
        """The vectors, ids (or None) and metadata table of each row group, in file order; with
        `metadata=False` the metadata columns are not read (the driver's pass needs none of them:
        reading them only grew its peak memory)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        opened: tuple[int, pq.ParquetFile] | None = None  # one open file at a time
        for number, group, _ in self.row_groups:
            path = self.files[number]
            try:
                if opened is None or opened[0] != number:
                    opened = (number, pq.ParquetFile(path))
                wanted = [c for c in self.columns if metadata or c not in self.metadata_columns]
                table = opened[1].read_row_group(group, columns=wanted)
            except (pa.ArrowException, OSError) as exc:
                raise ShardserveError(f"{path}: cannot read parquet ({exc})") from None
            yield parquet_arrays(path, table, self.columns[0], self.id_column,
                                 list(self.metadata_columns) if metadata else [])


NPY_CHUNK_ROWS = 65536  # rows per read of a .npy file: 32 MB at 128 float32 dims


@dataclass(frozen=True)
class NpySource:
    """A directory (or glob) of .npy files, autofaiss's input layout: vectors only (row numbers are
    the ids), each file memory-mapped and read NPY_CHUNK_ROWS rows at a time."""

    name: str
    files: tuple[str, ...]
    row_groups: tuple[tuple[int, int, int], ...]  # (file number, first row, rows)
    id_column: str | None = None
    metadata_columns: tuple[str, ...] = ()

    @classmethod
    def open(cls, spec: str) -> NpySource:
        files = npy_files(spec)
        matrices = [open_npy(path) for path in files]
        check_same_dim(spec, matrices)
        groups = [(number, first, min(NPY_CHUNK_ROWS, len(matrix) - first))
                  for number, matrix in enumerate(matrices)
                  for first in range(0, len(matrix), NPY_CHUNK_ROWS)]
        return cls(dataset_name(spec), tuple(str(path) for path in files), tuple(groups))

    @property
    def rows(self) -> int:
        return sum(rows for _, _, rows in self.row_groups)

    def read(self, metadata: bool = True) -> Iterator[VectorRows]:
        """The vectors of each chunk (no ids, no metadata), in file order."""
        opened: tuple[int, np.ndarray] | None = None
        for number, first, rows in self.row_groups:
            if opened is None or opened[0] != number:
                opened = (number, open_npy(Path(self.files[number])))
            yield VectorRows(as_float32(opened[1][first:first + rows]), None, None)


Source = ParquetSource | NpySource  # what the stages read: rows in a fixed order, in pieces


def open_source(spec: str, vector_column: str | None = None, id_column: str | None = None,
                metadata_columns: list[str] | None = None) -> Source:
    """Parquet files or a directory of .npy files, opened for streaming (nothing read yet)."""
    if is_npy_dir_spec(spec):
        if vector_column or id_column or metadata_columns:
            raise ShardserveError("--vector-column/--id-column/--metadata-columns apply to parquet data, "
                                  f"not to the .npy files of {spec!r}")
        return NpySource.open(spec)
    return ParquetSource.open(spec, vector_column, id_column, metadata_columns)


@dataclass(frozen=True)
class Piece:
    """One read of the source, with every row placed: the one numbering rule of every stage (and of
    the in-memory path): base position = file row, rows past `base_rows` (--limit) out; eval's
    query rows (shardserve.data.datasets.self_query_rows) are base rows too, only marked."""

    matrix: np.ndarray
    ids: np.ndarray | None  # the user's ids of these rows (parquet id column), else None
    table: object  # their metadata columns (pyarrow), else None
    first_row: int  # file row of matrix[0]
    position: np.ndarray  # base position of each row
    is_query: np.ndarray  # also one of eval's queries
    base: np.ndarray  # rows that are base rows within base_rows


def in_sorted(values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """`np.isin(x, values)` for sorted `values`, by binary search: np.isin hashes the whole sample
    (up to 2M rows) again for every row group, most of the driver's pass at scale."""
    if not len(values):
        return np.zeros(len(x), bool)
    at = np.minimum(np.searchsorted(values, x), len(values) - 1)
    return values[at] == x


def pieces(source: Source, base_rows: int, metadata: bool = True) -> Iterator[Piece]:
    queries = self_query_rows(base_rows)
    start = 0
    for matrix, ids, table in source.read(metadata):
        rows = np.arange(start, start + len(matrix))
        yield Piece(matrix, ids, table, start, rows, in_sorted(queries, rows), rows < base_rows)
        start += len(matrix)


def base_chunks(source: Source, base_rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first base position, its base rows) of each piece: base positions are contiguous in one."""
    for piece in pieces(source, base_rows):
        if piece.base.any():
            yield int(piece.position[piece.base][0]), piece.matrix[piece.base]


@dataclass(frozen=True)
class Scan:
    """What the driver's pass learned: enough to train and to write the manifest, not the data."""

    base_rows: int
    dim: int
    fingerprint: str  # == shardserve.data.datasets.Dataset.fingerprint() of the same files
    train: np.ndarray  # the training sample, prepared for the metric
    ids: np.ndarray  # the id of every base row: the user's, else row numbers
    queries: np.ndarray  # eval's query vectors: SELF_QUERIES of the base rows, still indexed
    query_rows: np.ndarray  # the base row of each query (left out of its own ground truth)


def scan(source: Source, metric: str, train_rows: np.ndarray | None, limit: int | None) -> Scan:
    """One pass over every row group: checks, the fingerprint, the sample, the ids.

    `train_rows`: sorted base positions to keep for training (None: all of them, for small data).
    """
    total = source.rows
    base_rows = total if limit is None else min(limit, total)
    query_rows = self_query_rows(base_rows)
    digest = hashlib.sha256()
    # The sample is filled in place: one copy of it in memory, however many row groups feed it.
    train: np.ndarray | None = None
    queries, ids, dim, filled = [], [], None, 0
    for piece in pieces(source, base_rows, metadata=False):
        matrix, base = piece.matrix, piece.base
        if dim is None:
            dim = matrix.shape[1]
            # the data's fingerprint, as data.datasets.Dataset.fingerprint() has it (not the build's metric)
            digest.update(f"{BASE_ONLY_METRIC}:{(base_rows, dim)}:{(len(query_rows), dim)}".encode())
            train = np.empty((base_rows if train_rows is None else len(train_rows), dim), np.float32)
        elif matrix.shape[1] != dim:
            raise ShardserveError(f"{source.name}: files hold vectors of different dimensions "
                                  f"{sorted({dim, matrix.shape[1]})}")
        bad = np.flatnonzero(~np.isfinite(matrix).all(axis=1) & base)
        if bad.size:
            raise ShardserveError(f"dataset {source.name}: base rows contain NaN/Inf (first at file row "
                                  f"{piece.first_row + int(bad[0])})")
        if base.any():
            digest.update(np.ascontiguousarray(matrix[base]).data.cast("B"))
        queries.append(matrix[piece.is_query & base])
        if piece.ids is not None:
            ids.append(piece.ids[base])
        wanted = base if train_rows is None else base & in_sorted(train_rows, piece.position)
        taken = int(wanted.sum())
        assert train is not None  # sized when the first piece came
        train[filled:filled + taken] = matrix[wanted]
        filled += taken
    if dim is None or train is None:
        raise ShardserveError(f"dataset {source.name}: no rows")
    query_matrix = np.ascontiguousarray(np.concatenate(queries))
    digest.update(query_matrix.data.cast("B"))
    all_ids = np.concatenate(ids) if ids else np.arange(base_rows, dtype=np.int64)
    if source.id_column:
        check_ids(source.name, all_ids, base_rows)
        digest.update(np.ascontiguousarray(all_ids).data.cast("B"))
    if metric == "cosine":  # as prepare_vectors does, in place
        import faiss

        faiss.normalize_L2(train)
    return Scan(base_rows, dim, digest.hexdigest()[:16], train, all_ids, query_matrix, query_rows)


def add_shard_streaming(source: Source, empty: bytes, metric: str, shard: int, partition: Partition,
                        base_rows: int, location: Location) -> tuple[str, str | None]:
    """Stream every row group, add this shard's rows (index.partition), write the shard file and its
    metadata; return their manifest entries as JSON."""
    import faiss
    import pyarrow as pa

    from index_build.publish import shard_file_name, write_file
    from shardserve.index.indexes import index_from_bytes, index_to_bytes

    faiss.omp_set_num_threads(1)  # one CPU per task, as in the in-memory Ray build
    index = index_from_bytes(empty)
    assigner = assigner_of(empty) if partition.kind == BY_LISTS else None
    ids_kept, tables = [], []
    for piece in pieces(source, base_rows):
        rows = np.flatnonzero(piece.base)
        if assigner is None:  # by row: pick this shard's rows first, prepare only those
            rows = rows[partition.shard_of(piece.position[rows]) == shard]
            vectors = prepare_vectors(np.ascontiguousarray(piece.matrix[rows]), metric)
        else:  # by list: every base row's list decides, so all of them are prepared and assigned
            vectors = prepare_vectors(np.ascontiguousarray(piece.matrix[rows]), metric)
            mine = partition.shard_of(piece.position[rows], vectors, assigner) == shard
            rows, vectors = rows[mine], vectors[mine]
        if not len(rows):
            continue
        ids = piece.ids[rows] if piece.ids is not None else piece.position[rows].astype(np.int64)
        index.add_with_ids(np.ascontiguousarray(vectors), ids)
        ids_kept.append(ids)
        if source.metadata_columns:
            tables.append(piece.table.take(pa.array(rows)))  # type: ignore[attr-defined]
    entry = write_file(location, shard_file_name(shard), index_to_bytes(index), int(index.ntotal))
    meta = None
    if source.metadata_columns:
        ids = np.concatenate(ids_kept) if ids_kept else np.zeros(0, np.int64)
        table = pa.concat_tables(tables).combine_chunks()
        meta = write_metadata(location, shard, ids, table).model_dump_json()
    return entry.model_dump_json(), meta


def build_streaming(spec: str, *, params, location: Location, backend: str, vector_column: str | None,
                    id_column: str | None, metadata_columns: list[str] | None, limit: int | None,
                    factory_for: Callable[[int, int], tuple[str, str | None]],
                    discard_writes: bool = False, embedder: ModelIdentity | None = None,
                    name: str | None = None, text_column: str | None = None, extra: dict | None = None,
                    version_id: str | None = None, started: float | None = None) -> Manifest:
    """Build `spec` (parquet or .npy files) without holding its base set anywhere.

    Arguments (as `index_build.job.build_index` documents them): params, the build's; location,
    where the version is published; backend, "ray" or "local"; vector_column, id_column,
    metadata_columns, limit, as for `load_dataset`; factory_for(rows, dim), the factory and why,
    resolved once the size is known (`--index auto`); discard_writes, embedder, version_id and
    started, as for `publish_build`. A build from text (index_build.embed_corpus) also gives the
    dataset's `name` (where its embedded vectors are), its `text_column`, and `extra` build
    parameters."""
    from index_build.publish import BuildParams, publish_build, training_rows
    from shardserve.index.manifest import DatasetInfo
    from shardserve.index.metadata import column_kinds

    source = open_source(spec, vector_column, id_column, metadata_columns)
    if limit is not None and limit < 1:
        raise ShardserveError(f"--limit must be >= 1, got {limit}")
    base_rows = source.rows if limit is None else min(limit, source.rows)
    first_matrix, _, first_table = next(source.read())
    dim = first_matrix.shape[1]
    factory, auto = factory_for(base_rows, dim)
    params = BuildParams(factory, params.shards, params.metric, params.train_size, params.seed)
    make_empty_index(factory, dim, params.metric)  # a bad factory fails before the pass
    if base_rows < params.shards:
        raise ShardserveError(f"{params.shards} shards need at least {params.shards} vectors, "
                              f"got {base_rows}")
    rows = training_rows(factory, dim, params.metric, base_rows, params.train_size, params.seed,
                         TRAIN_MAX_BYTES)
    scanned = scan(source, params.metric, rows, limit)
    kinds = (column_kinds(first_table.schema)  # type: ignore[attr-defined]  # a pyarrow Table
             if source.metadata_columns and first_table is not None else {})
    info = DatasetInfo(name=name or source.name, fingerprint=scanned.fingerprint, vector_column=vector_column,
                       id_column=id_column, metadata_columns=list(source.metadata_columns),
                       metadata_kinds=kinds, text_column=text_column)

    def add(empty: bytes, partition: Partition, at: Location, timings: dict):
        from shardserve.index.manifest import ShardEntry
        from shardserve.runtime.timing import timed

        with timed(f"stream+add+write {params.shards} shards ({backend})", timings):
            if backend == "ray":
                written = _add_shards_ray(source, empty, params.metric, partition, base_rows, at)
            else:
                written = [add_shard_streaming(source, empty, params.metric, s, partition, base_rows, at)
                           for s in range(params.shards)]
        entries = [ShardEntry.model_validate_json(entry) for entry, _ in written]
        metadata = ([MetadataEntry.model_validate_json(meta or "") for _, meta in written]
                    if source.metadata_columns else None)
        return entries, metadata

    if backend == "ray":  # every check passed: only now start (or join) Ray
        from shardserve.runtime.ray_session import ensure_ray

        ensure_ray(serving_node=False)
    extra = {"backend": backend, "streaming": {"row_groups": len(source.row_groups),
                                               "train_rows": len(scanned.train),
                                               "train_max_bytes": TRAIN_MAX_BYTES}, **(extra or {})}
    return publish_build(location, params, info, dim, base_rows, lambda: scanned.train, add, extra, auto,
                         discard_writes, embedder, version_id, started)


def _add_shards_ray(source: Source, empty: bytes, metric: str, partition: Partition, base_rows: int,
                    location: Location) -> list[tuple[str, str | None]]:
    """Ray Data over shard specs: one task per shard streams the row groups and builds its shard."""
    import ray

    shards = partition.shards
    specs = ray.data.from_items([{"shard": s} for s in range(shards)], override_num_blocks=shards)
    written = specs.map_batches(  # fn_kwargs fill the task's other parameters
        _stream_shard_task,  # type: ignore[arg-type]
        batch_size=1, batch_format="numpy", num_cpus=1,
        fn_kwargs={"source": source, "empty": ray.put(empty), "metric": metric, "partition": partition,
                   "base_rows": base_rows, "location_uri": location.uri})
    rows = written.take_all()
    if len(rows) != shards:
        raise ShardserveError(f"Ray build wrote {len(rows)} of {shards} shards")
    return sorted((row["entry"], row["meta"] or None) for row in rows)


def _stream_shard_task(batch: dict[str, np.ndarray], source: Source, empty, metric: str,
                       partition: Partition, base_rows: int, location_uri: str) -> dict[str, np.ndarray]:
    import ray

    written = [add_shard_streaming(source, ray.get(empty), metric, int(shard), partition, base_rows,
                                   Location.parse(location_uri)) for shard in batch["shard"].tolist()]
    return {"entry": np.array([e for e, _ in written]), "meta": np.array([m or "" for _, m in written])}
