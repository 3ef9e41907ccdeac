"""Shard files memory-mapped (IO_FLAG_MMAP), checked against the manifest without reading them into
memory, and downloaded once per node from remote storage. Real FAISS files, no Ray (local backend)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from index_build.job import build_index
from shardserve.data.datasets import load_dataset
from shardserve.errors import ShardserveError
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location
from shardserve.query.searcher import ShardSearcher

DATASET = "synthetic:6000x32"


@pytest.fixture(scope="module", params=["IVF32,Flat", "IVF32,PQ8x4fs", "HNSW16", "Flat"])
def built(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("mmap") / "idx"
    build_index(DATASET, 2, request.param, str(out), backend="local")
    return request.param, out


@pytest.fixture(scope="module")
def ivf_index(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mmap-remote") / "idx"
    build_index(DATASET, 2, "IVF32,Flat", str(out), backend="local")
    return out


def _answers(searcher: ShardSearcher, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    distances, ids, _ = searcher.search(queries, 10, None)
    return distances, ids


def test_mapped_shard_answers_like_a_read_one(built: tuple[str, Path]) -> None:
    factory, out = built
    location = Location.parse(str(out))
    manifest = read_manifest(location)
    queries = load_dataset(DATASET, num_queries=50).queries
    for shard in range(len(manifest.shards)):
        mapped = ShardSearcher.load(location, manifest, shard, mmap=True)
        read = ShardSearcher.load(location, manifest, shard, mmap=False)
        for got, want in zip(_answers(mapped, queries), _answers(read, queries), strict=True):
            np.testing.assert_array_equal(got, want)
        # Plain IVF lists are served from the mapped file; other types are read in (FAISS copies them).
        assert mapped.mmapped == (factory == "IVF32,Flat")
        assert not read.mmapped


def _remote(out: Path) -> Location:
    """The same directory behind a non-local pyarrow filesystem: what s3:// looks like to the code."""
    return Location(pafs.SubTreeFileSystem(str(out), pafs.LocalFileSystem()), "", "subtree://idx")


def test_remote_shard_is_downloaded_once_checked_and_mapped(ivf_index: Path, tmp_path, monkeypatch) -> None:
    out = ivf_index
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    remote = _remote(out)
    manifest = read_manifest(remote)
    first = ShardSearcher.load(remote, manifest, 0)
    cached = list((tmp_path / "cache").rglob("*.faiss"))
    assert len(cached) == 1 and first.mmapped
    assert cached[0].read_bytes() == (out / manifest.shards[0].path).read_bytes()
    again = ShardSearcher.load(remote, manifest, 0)  # the cached copy, checked again
    queries = load_dataset(DATASET, num_queries=20).queries
    np.testing.assert_array_equal(_answers(first, queries)[1], _answers(again, queries)[1])
    assert len(list((tmp_path / "cache").rglob("*"))) == 2  # its directory and the file: no leftovers


def test_corrupt_remote_shard_is_refused_and_not_cached(ivf_index: Path, tmp_path, monkeypatch) -> None:
    out = ivf_index
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    manifest = read_manifest(Location.parse(str(copy)))
    shard_file = copy / manifest.shards[1].path
    data = bytearray(shard_file.read_bytes())
    data[-10] ^= 0xFF
    shard_file.write_bytes(bytes(data))
    with pytest.raises(ShardserveError, match="sha256 mismatch"):
        ShardSearcher.load(_remote(copy), read_manifest(_remote(copy)), 1)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # nothing half-trusted left
    with pytest.raises(ShardserveError, match="sha256 mismatch"):  # and the local path checks too
        ShardSearcher.load(Location.parse(str(copy)), manifest, 1)


def test_the_baseline_still_merges_shards_loaded_in_memory(ivf_index: Path) -> None:
    """Mapped IVF lists cannot be cloned or merged (FAISS): the uvicorn baseline reads its shards."""
    from loadtests.baseline_server import merged_searcher

    merged, _ = merged_searcher(str(ivf_index))
    manifest = read_manifest(Location.parse(str(ivf_index)))
    assert merged.index.ntotal == manifest.num_vectors and not merged.mmapped


@pytest.mark.parametrize(("field", "value"), [("sha256", "../../../../tmp/"), ("sha256", "ab" * 31),
                                              ("path", "../outside.faiss"), ("path", "/etc/passwd")])
def test_a_manifest_cannot_choose_where_bytes_are_written(ivf_index: Path, tmp_path, field: str,
                                                          value: str) -> None:
    """The digest names the download cache's directory and the path its file: a manifest whose
    sha256 is not 64 hex characters, or whose path leaves the index, is refused before either is used."""
    import json

    copy = tmp_path / "copy"
    shutil.copytree(ivf_index, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"][0][field] = value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardserveError, match="invalid manifest"):
        read_manifest(Location.parse(str(copy)))


def test_a_failed_download_leaves_no_temporary_file(ivf_index: Path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "copy"
    shutil.copytree(ivf_index, copy)
    manifest = read_manifest(Location.parse(str(copy)))
    (copy / manifest.shards[0].path).unlink()  # the download fails once it starts
    with pytest.raises(ShardserveError, match="cannot read"):
        ShardSearcher.load(_remote(copy), manifest, 0)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
