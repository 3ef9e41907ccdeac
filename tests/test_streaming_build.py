"""The streaming parquet build (index_build.streaming) against the in-memory build of the same files:
same shards byte for byte, ids and metadata round-trip, bad data refused before anything is
written, an interrupted build publishes nothing. Real parquet files (several row groups), real FAISS."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from index_build.job import BuildParams, build_from_dataset, build_index
from index_build.streaming import ParquetSource, scan
from shardserve.data.datasets import load_dataset
from shardserve.errors import ShardserveError
from shardserve.index.manifest import MANIFEST, read_manifest
from shardserve.index.metadata import MetadataTable
from shardserve.index.storage import Location
from tests.shared import FILES, ROWS, source_id, write_parquet


def _with_row_groups(source: Path, rows_per_group: int = 700) -> Path:
    """Rewrite each file with small row groups, so every file is read in several pieces."""
    for path in sorted(source.glob("*.parquet")):
        pq.write_table(pq.read_table(path), path, row_group_size=rows_per_group)
    return source


@pytest.fixture
def parquet_dir(tmp_path: Path) -> Path:
    return _with_row_groups(write_parquet(tmp_path / "emb"))


@pytest.mark.parametrize(("factory", "with_ids", "metric"),
                         [("IVF32,Flat", True, "l2"),
                          pytest.param("IVF32,PQ4", False, "l2", marks=pytest.mark.slow),  # PQ training
                          ("Flat", True, "l2"),
                          ("IVF32,Flat", False, "cosine")])
def test_streaming_build_writes_the_in_memory_build_byte_for_byte(
        parquet_dir: Path, tmp_path: Path, factory: str, with_ids: bool, metric: str) -> None:
    id_column = "doc_id" if with_ids else None
    meta = ["caption"] if with_ids else None
    streamed = build_index(str(parquet_dir), 3, factory, str(tmp_path / "streamed"), backend="local",
                           metric=metric, vector_column="emb", id_column=id_column, metadata_columns=meta)
    data = load_dataset(str(parquet_dir), vector_column="emb", id_column=id_column, metadata_columns=meta)
    in_memory = build_from_dataset(data, BuildParams(factory, 3, metric),
                                   Location.parse(str(tmp_path / "mem")),
                                   backend="local", vector_column="emb", id_column=id_column)
    assert streamed.index_version == in_memory.index_version
    assert [s.sha256 for s in streamed.shards] == [s.sha256 for s in in_memory.shards]
    assert streamed.dataset.fingerprint == data.fingerprint()  # eval and the swap gate find the data
    assert streamed.num_vectors == len(data.base)
    if meta:
        assert [m.sha256 for m in streamed.metadata] == [m.sha256 for m in in_memory.metadata]
    assert streamed.build.params["streaming"]["row_groups"] > FILES


def test_ids_and_metadata_round_trip_through_the_shards(parquet_dir: Path, tmp_path: Path) -> None:
    from shardserve.query.searcher import load_all_shards

    out = tmp_path / "idx"
    build_index(str(parquet_dir), 2, "IVF16,Flat", str(out), backend="local", vector_column="emb",
                id_column="doc_id", metadata_columns=["caption"])
    manifest, searchers = load_all_shards(str(out))
    stored = np.concatenate([faiss_ids(s.index) for s in searchers])
    data = load_dataset(str(parquet_dir), vector_column="emb", id_column="doc_id")
    assert sorted(stored.tolist()) == sorted(data.ids.tolist())  # every base row once, under its id
    location = Location.parse(str(out))  # the published manifest's paths lead into its version
    for entry in manifest.metadata:
        table = MetadataTable.load(location, entry)
        source_rows = (table.ids - 2**40) // 1_000_003  # _source_id inverted
        np.testing.assert_array_equal(source_id(source_rows), table.ids)
        assert table.table.column("caption").to_pylist() == [f"caption {r}" for r in source_rows]


def faiss_ids(index) -> np.ndarray:
    import faiss

    ivf = faiss.extract_index_ivf(index)
    lists = ivf.invlists
    return np.concatenate([faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy()
                           for i in range(ivf.nlist) if lists.list_size(i)])


def test_duplicate_ids_and_a_missing_column_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    ids = source_id(np.arange(ROWS))
    ids[ROWS - 1] = ids[0]  # two rows, in the first and the last file
    source = _with_row_groups(write_parquet(tmp_path / "dup", ids))
    with pytest.raises(ShardserveError, match="1 duplicate ids, e.g. id"):
        build_index(str(source), 2, "IVF16,Flat", str(tmp_path / "out"), backend="local",
                    vector_column="emb", id_column="doc_id")
    with pytest.raises(ShardserveError, match="no metadata column 'url'"):
        build_index(str(source), 2, "IVF16,Flat", str(tmp_path / "out"), backend="local",
                    vector_column="emb", metadata_columns=["url"])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.faiss"))


def test_a_nan_row_in_a_late_row_group_is_refused(tmp_path: Path) -> None:
    source = write_parquet(tmp_path / "nan")
    last = sorted(source.glob("*.parquet"))[-1]
    table = pq.read_table(last)
    vectors = np.array(table.column("emb").to_pylist(), dtype=np.float32)
    vectors[-5, 2] = np.nan
    table = table.set_column(0, "emb", pa.array(list(vectors), type=pa.list_(pa.float32())))
    pq.write_table(table, last, row_group_size=500)
    with pytest.raises(ShardserveError, match="contain NaN/Inf"):
        build_index(str(source), 2, "IVF16,Flat", str(tmp_path / "out"), backend="local", vector_column="emb")


def test_an_interrupted_streaming_build_publishes_nothing(parquet_dir: Path, tmp_path: Path) -> None:
    """A row group that cannot be read mid-way through the adds: no manifest, no version left."""
    out = tmp_path / "idx"
    source = ParquetSource.open(str(parquet_dir), "emb", None, None)
    scan(source, "l2", None, None)  # readable now
    victim = sorted(parquet_dir.glob("*.parquet"))[-1]
    original = victim.read_bytes()

    import index_build.streaming as streaming

    real_add = streaming.add_shard_streaming

    def add_then_break(*args, **kwargs):
        victim.write_bytes(original[: len(original) // 2])  # the file is cut while the build runs
        return real_add(*args, **kwargs)

    streaming.add_shard_streaming = add_then_break
    try:
        with pytest.raises(ShardserveError, match="cannot read parquet"):
            build_index(str(parquet_dir), 2, "IVF16,Flat", str(out), backend="local", vector_column="emb")
    finally:
        streaming.add_shard_streaming = real_add
        victim.write_bytes(original)
    assert not (out / MANIFEST).exists()
    assert not any(out.rglob("*.faiss"))
    # and a rebuild from the intact files then publishes normally
    manifest = build_index(str(parquet_dir), 2, "IVF16,Flat", str(out), backend="local", vector_column="emb")
    assert read_manifest(Location.parse(str(out))).index_version == manifest.index_version


@pytest.mark.slow
def test_the_ray_backend_streams_the_same_shards(ray_cluster, parquet_dir: Path, tmp_path: Path) -> None:
    local = build_index(str(parquet_dir), 3, "IVF32,Flat", str(tmp_path / "local"), backend="local",
                        vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    on_ray = build_index(str(parquet_dir), 3, "IVF32,Flat", str(tmp_path / "ray"), backend="ray",
                         vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    assert on_ray.index_version == local.index_version
    assert on_ray.build.params["backend"] == "ray"


def test_limit_keeps_the_first_base_rows_like_the_in_memory_reader(parquet_dir: Path, tmp_path: Path) -> None:
    streamed = build_index(str(parquet_dir), 2, "Flat", str(tmp_path / "s"), backend="local",
                           vector_column="emb", id_column="doc_id", limit=1234)
    data = load_dataset(str(parquet_dir), vector_column="emb", id_column="doc_id", limit=1234)
    in_memory = build_from_dataset(data, BuildParams("Flat", 2, "l2"), Location.parse(str(tmp_path / "m")),
                                   backend="local", vector_column="emb", id_column="doc_id")
    assert streamed.num_vectors == 1234 and streamed.index_version == in_memory.index_version
    assert streamed.dataset.fingerprint == data.fingerprint()


# --- directories of .npy files (autofaiss's input layout) ------------------------------------------

@pytest.fixture
def npy_dir(tmp_path: Path, monkeypatch) -> Path:
    """Three files of uneven length, one float64 (converted like the in-memory reader), read in
    chunks smaller than a file so chunks and files both have edges."""
    import index_build.streaming as streaming

    monkeypatch.setattr(streaming, "NPY_CHUNK_ROWS", 500)
    rng = np.random.default_rng(7)
    directory = tmp_path / "npy"
    directory.mkdir()
    for name, rows, dtype in (("part-0.npy", 1500, np.float32), ("part-1.npy", 1234, np.float64),
                              ("part-2.npy", 1800, np.float32)):
        np.save(directory / name, rng.normal(size=(rows, 16)).astype(dtype))
    return directory


@pytest.mark.parametrize("factory", ["IVF16,Flat", "Flat"])
def test_npy_directory_streams_into_the_in_memory_build_byte_for_byte(
        npy_dir: Path, tmp_path: Path, factory: str) -> None:
    streamed = build_index(str(npy_dir), 3, factory, str(tmp_path / "streamed"), backend="local")
    as_glob = build_index(str(npy_dir / "*.npy"), 3, factory, str(tmp_path / "glob"), backend="local")
    data = load_dataset(str(npy_dir))
    in_memory = build_from_dataset(data, BuildParams(factory, 3, "l2"), Location.parse(str(tmp_path / "mem")),
                                   backend="local")
    assert len(data.base) == 1500 + 1234 + 1800  # every row indexed; queries are some of them
    assert streamed.dataset.fingerprint == data.fingerprint()
    assert [s.sha256 for s in streamed.shards] == [s.sha256 for s in in_memory.shards]
    assert [s.sha256 for s in as_glob.shards] == [s.sha256 for s in streamed.shards]
    assert streamed.build.params["streaming"]["row_groups"] == 3 + 3 + 4  # 500-row chunks per file


def test_npy_directory_refuses_mixed_dimensions_and_non_numbers(npy_dir: Path, tmp_path: Path) -> None:
    np.save(npy_dir / "part-3.npy", np.zeros((10, 8), np.float32))
    with pytest.raises(ShardserveError, match="different dimensions"):
        build_index(str(npy_dir), 2, "Flat", str(tmp_path / "a"), backend="local")
    (npy_dir / "part-3.npy").unlink()
    np.save(npy_dir / "part-3.npy", np.array([["a", "b"]]))
    with pytest.raises(ShardserveError, match="part-3.npy: expected real numbers"):
        build_index(str(npy_dir), 2, "Flat", str(tmp_path / "b"), backend="local")
    with pytest.raises(ShardserveError, match="apply to parquet data"):
        build_index(str(npy_dir), 2, "Flat", str(tmp_path / "c"), backend="local", id_column="doc_id")
    assert not (tmp_path / "a" / MANIFEST).exists() and not (tmp_path / "b" / MANIFEST).exists()


# --- datasets on a pyarrow filesystem (s3://, gs://, file://, ...) ----------------------------------

@pytest.mark.parametrize("form", ["directory", "glob"])
def test_a_dataset_uri_builds_what_the_local_path_builds(parquet_dir: Path, tmp_path: Path,
                                                         form: str) -> None:
    """The URI path (pyarrow's FileSystem.from_uri, listing, each file read by URI) on file://,
    the filesystem this machine has; s3:// and gs:// go through the same calls."""
    from shardserve.data.datasets import dataset_name, parquet_files

    uri = parquet_dir.as_uri() + ("/*.parquet" if form == "glob" else "/")
    assert parquet_files(uri) == [p.as_uri() for p in sorted(parquet_dir.glob("*.parquet"))]
    assert dataset_name(uri) == dataset_name(str(parquet_dir)) == parquet_dir.name
    local = build_index(str(parquet_dir), 2, "IVF32,Flat", str(tmp_path / "local"), backend="local",
                        vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    remote = build_index(uri, 2, "IVF32,Flat", str(tmp_path / "uri"), backend="local",
                         vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    assert remote.index_version == local.index_version
    assert remote.dataset.fingerprint == local.dataset.fingerprint
    in_memory = load_dataset(uri, vector_column="emb", id_column="doc_id")  # eval's reader, too
    assert in_memory.fingerprint() == local.dataset.fingerprint


def test_a_dataset_uri_that_matches_nothing_is_one_clear_error(tmp_path: Path) -> None:
    from shardserve.data.datasets import parquet_files

    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardserveError, match="no parquet files match"):
        parquet_files((tmp_path / "empty").as_uri() + "/*.parquet")
    with pytest.raises(ShardserveError, match="not found"):
        parquet_files((tmp_path / "nowhere").as_uri())
    with pytest.raises(ShardserveError, match="cannot list"):
        parquet_files("nosuchscheme://bucket/emb/")


def test_in_sorted_is_isin_for_sorted_values() -> None:
    from index_build.streaming import in_sorted

    rng = np.random.default_rng(0)
    values = np.sort(rng.choice(10_000, 700, replace=False))
    x = rng.integers(-5, 10_010, 5_000)
    assert (in_sorted(values, x) == np.isin(x, values)).all()
    assert not in_sorted(values[:0], x).any()
