"""Parquet files: one, a directory or a glob of them, local or at any pyarrow URI (s3://, gs://,
file://): the one format read from remote storage. The vectors are a list column; an id column and
metadata columns are optional. Base-only: eval's queries are some of the rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardserve.data.dataset import Dataset, VectorRows, base_only
from shardserve.data.paths import check_same_dim, dataset_name, holds, is_glob, is_uri, local_files
from shardserve.errors import ShardserveError


def is_parquet_spec(spec: str) -> bool:
    """A directory of parquet files, a glob of them, or one parquet file; any pyarrow URI
    (s3://bucket/emb/, gs://…/*.parquet): parquet is the one format read from remote storage."""
    if is_uri(spec):
        return True
    if is_glob(spec):
        return spec.endswith(".parquet") or spec.endswith("*")
    path = Path(spec)
    return path.suffix.lower() == ".parquet" or holds(path, ".parquet")


def parquet_files(spec: str) -> list[str]:
    """The parquet files of a file, directory or glob (local, or a pyarrow URI: s3://, gs://,
    file://, ...), in name order: their rows are numbered in that order. Readers take each as it
    is (pyarrow opens a URI's filesystem itself), so shard tasks on other nodes read them too."""
    if is_uri(spec):
        return _uri_files(spec)
    files = local_files(spec, ".parquet") if is_glob(spec) or Path(spec).is_dir() else [Path(spec)]
    if not files:
        raise ShardserveError(f"no parquet files match {spec!r}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ShardserveError(f"dataset file not found: {missing[0]}")
    return [str(f) for f in files]


def _uri_files(spec: str) -> list[str]:
    """A URI's files: the file itself, a directory's *.parquet, or a glob in its last part."""
    import fnmatch

    import pyarrow as pa
    import pyarrow.fs as pafs

    uri, _, query = spec.partition("?")  # e.g. ?region=…: kept on every file's URI
    scheme, head, tail = uri.split("://", 1)[0], *uri.rstrip("/").rsplit("/", 1)
    pattern = tail if is_glob(tail) else None
    try:
        fs, path = pafs.FileSystem.from_uri(f"{head}?{query}" if pattern and query else
                                            head if pattern else spec)
        kind = fs.get_file_info(path).type
        if pattern is None and kind == pafs.FileType.File:
            paths = [path]
        elif kind == pafs.FileType.Directory:
            paths = [info.path for info in fs.get_file_info(pafs.FileSelector(path))
                     if info.type == pafs.FileType.File
                     and fnmatch.fnmatch(info.base_name, pattern or "*.parquet")]
        else:
            raise ShardserveError(f"dataset not found: {spec}")
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ShardserveError(f"cannot list {spec!r}: {exc}") from None
    if not paths:
        raise ShardserveError(f"no parquet files match {spec!r}")
    suffix = f"?{query}" if query else ""
    return sorted(f"{scheme}://{p}{suffix}" for p in paths)


def load_parquet(spec: str, vector_column: str | None, id_column: str | None,
                  metadata_columns: list[str]) -> Dataset:
    """Vectors (ids, metadata) of every file, in file order, every row in the base; queries are some
    of those rows, as for any base-only file. Read in memory: the build holds the matrix in the
    object store once."""
    parts = [read_parquet_file(path, vector_column, id_column, metadata_columns)
             for path in parquet_files(spec)]
    check_same_dim(spec, [part.matrix for part in parts])
    matrix = np.concatenate([part.matrix for part in parts]) if len(parts) > 1 else parts[0].matrix
    ids = None if id_column is None else np.concatenate([part.ids for part in parts])
    metadata = None
    if metadata_columns:
        import pyarrow as pa

        metadata = pa.concat_tables([part.metadata for part in parts]).combine_chunks()
    return base_only(dataset_name(spec), matrix, ids=ids, metadata=metadata)


def read_parquet_file(path: Path | str, vector_column: str | None = None, id_column: str | None = None,
                      metadata_columns: list[str] | None = None) -> VectorRows:
    """One parquet file, reading only the columns asked for (schema checked first, each problem
    named): its vectors, ids (if an id column is named) and metadata columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = parquet_columns(path, vector_column, id_column, metadata_columns)
    try:
        table = pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise ShardserveError(f"{path}: cannot read parquet ({exc})") from None
    return parquet_arrays(path, table, columns[0], id_column, metadata_columns or [])


def parquet_columns(path: Path | str, vector_column: str | None, id_column: str | None,
                    metadata_columns: list[str] | None) -> list[str]:
    """The columns to read from `path` (the vector column first), its schema checked: every problem
    named in one line. Reads the footer only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise ShardserveError(f"{path}: cannot read parquet ({exc})") from None
    column = vector_column or next((f.name for f in schema if pa.types.is_list(f.type)
                                    or pa.types.is_fixed_size_list(f.type) or pa.types.is_large_list(f.type)),
                                   None)
    if column is None:
        raise ShardserveError(f"{path}: no list<float> column")
    metadata_columns = metadata_columns or []
    for name in [column, *([id_column] if id_column else []), *metadata_columns]:
        if name not in schema.names:
            what = "metadata column" if name in metadata_columns else "column"
            raise ShardserveError(f"{path}: no {what} {name!r} (columns: {schema.names})")
    value_type = getattr(schema.field(column).type, "value_type", None)
    if value_type is None or not (pa.types.is_floating(value_type) or pa.types.is_integer(value_type)):
        raise ShardserveError(f"{path}: column {column!r} is {schema.field(column).type}, "
                              "expected a list of numbers")
    if id_column and not pa.types.is_integer(schema.field(id_column).type):
        raise ShardserveError(f"{path}: id column {id_column!r} is {schema.field(id_column).type}, "
                              "expected integers")
    for name in metadata_columns:
        kind = schema.field(name).type
        if name in ("id", id_column):
            raise ShardserveError(f"metadata column {name!r}: ids are returned as `ids` already")
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_integer(kind)
                or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            raise ShardserveError(f"{path}: metadata column {name!r} is {kind}: only strings, numbers "
                                  "and booleans are returned")
    return list(dict.fromkeys([column, *([id_column] if id_column else []), *metadata_columns]))


def parquet_arrays(path: Path | str, table, column: str, id_column: str | None,
                   metadata_columns: list[str]) -> VectorRows:
    """The vectors, ids (or None) and metadata table of rows read by `parquet_columns`."""
    values = table.column(column).combine_chunks()
    lengths = np.asarray(values.value_lengths()) if hasattr(values, "value_lengths") else None
    if lengths is not None and (lengths.size == 0 or (lengths != lengths[0]).any()):
        raise ShardserveError(f"{path}: column {column!r} has rows of different lengths or is empty")
    matrix = np.asarray(values.flatten(), dtype=np.float32).reshape(len(values), -1)
    ids = None
    if id_column:
        id_values = table.column(id_column)
        if id_values.null_count:
            raise ShardserveError(f"{path}: id column {id_column!r} has {id_values.null_count} nulls")
        ids = id_values.to_numpy().astype(np.int64)
    return VectorRows(matrix, ids, table.select(metadata_columns))
