"""s3:// end to end against an S3 API server on loopback (moto's server: real HTTP, real S3 wire
protocol, pyarrow's own S3 client), the way users point shardserve at a bucket: credentials and the
endpoint in the standard AWS environment variables (set by tests/conftest.py before Ray starts, so
Ray's workers have them too), plain `s3://bucket/prefix` URIs.

Covered: a parquet dataset read from a bucket, the streaming build writing shards + manifest to a
bucket (same index version and shard bytes as a local build), in the driver and in Ray's workers;
shards loaded back from the bucket (downloaded once into the node's cache, sha256-checked,
searched) and the dataset's metadata.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from index_build.job import build_index
from tests.conftest import S3_PORT
from tests.shared import write_parquet

moto_server = pytest.importorskip("moto.server")
BUCKET = "shardserve-test"


@pytest.fixture(scope="module")
def bucket():
    """`s3://shardserve-test` on a loopback S3 server where the AWS environment points."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=S3_PORT, verbose=False)
    server.start()
    fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{S3_PORT}", scheme="http", access_key="test",
                           secret_key="test", region="us-east-1", allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    try:
        yield fs
    finally:
        server.stop()


def _upload(fs: pafs.FileSystem, local: Path, prefix: str) -> None:
    for path in sorted(local.glob("*.parquet")):
        with fs.open_output_stream(f"{BUCKET}/{prefix}/{path.name}") as sink:
            sink.write(path.read_bytes())


def test_a_bucket_dataset_builds_into_a_bucket_what_local_files_build(bucket, tmp_path: Path,
                                                                      monkeypatch) -> None:
    from shardserve.data.datasets import parquet_files
    from shardserve.query.searcher import load_all_shards

    local_emb = write_parquet(tmp_path / "emb")
    _upload(bucket, local_emb, "emb")
    files = parquet_files(f"s3://{BUCKET}/emb/")
    assert files == [f"s3://{BUCKET}/emb/{p.name}" for p in sorted(local_emb.glob("*.parquet"))]
    options = dict(backend="local", vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    local = build_index(str(local_emb), 2, "IVF32,Flat", str(tmp_path / "local"), **options)
    remote = build_index(f"s3://{BUCKET}/emb/", 2, "IVF32,Flat", f"s3://{BUCKET}/indexes/emb", **options)
    assert remote.index_version == local.index_version
    assert [s.sha256 for s in remote.shards] == [s.sha256 for s in local.shards]
    assert [m.sha256 for m in remote.metadata] == [m.sha256 for m in local.metadata]
    listed = bucket.get_file_info(pafs.FileSelector(f"{BUCKET}/indexes/emb", recursive=True))
    assert any(info.path.endswith("manifest.json") for info in listed)

    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    manifest, from_bucket = load_all_shards(f"s3://{BUCKET}/indexes/emb")
    _, from_disk = load_all_shards(str(tmp_path / "local"))
    assert manifest.index_version == local.index_version
    assert all(s.mmapped for s in from_bucket)  # downloaded into the cache once, then mapped
    queries = np.random.default_rng(3).normal(size=(5, from_disk[0].dim)).astype(np.float32)
    for shard_bucket, shard_disk in zip(from_bucket, from_disk, strict=True):
        got, want = shard_bucket.search(queries, 5), shard_disk.search(queries, 5)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.slow  # starts Ray: not in `make test-fast`
def test_ray_workers_read_and_write_the_bucket(bucket, ray_cluster, tmp_path: Path) -> None:
    """The streaming build on Ray: its tasks read the row groups from the bucket and write the shards
    to it in Ray worker processes (AWS variables from their node), byte-equal to a local build."""
    local_emb = write_parquet(tmp_path / "emb")
    _upload(bucket, local_emb, "emb-ray")
    options = dict(vector_column="emb", id_column="doc_id", metadata_columns=["caption"])
    local = build_index(str(local_emb), 2, "IVF32,Flat", str(tmp_path / "local"), backend="local", **options)
    on_ray = build_index(f"s3://{BUCKET}/emb-ray/", 2, "IVF32,Flat", f"s3://{BUCKET}/indexes/ray",
                         backend="ray", **options)
    assert on_ray.index_version == local.index_version
    assert [s.sha256 for s in on_ray.shards] == [s.sha256 for s in local.shards]
    assert [m.sha256 for m in on_ray.metadata] == [m.sha256 for m in local.metadata]


def test_filesystem_options_in_the_uri_survive_the_version_directory(bucket, tmp_path: Path) -> None:
    """`s3://bucket/idx?endpoint_override=…`: the pinned version's URI (what replicas are deployed
    with) keeps the query after its path, and reads the same manifest."""
    from shardserve.index.manifest import pinned_location, read_manifest
    from shardserve.index.storage import Location

    port = S3_PORT
    uri = f"s3://{BUCKET}/indexes/query?endpoint_override=127.0.0.1:{port}&scheme=http"
    built = build_index("synthetic:600x8", 2, "IVF4,Flat", uri, backend="local")
    pinned = pinned_location(uri)
    assert pinned.startswith(f"s3://{BUCKET}/indexes/query/versions/") and pinned.endswith(
        f"?endpoint_override=127.0.0.1:{port}&scheme=http")
    assert read_manifest(Location.parse(pinned)).index_version == built.index_version


def test_a_missing_bucket_prefix_is_one_clear_error(bucket) -> None:
    from shardserve.data.datasets import parquet_files
    from shardserve.errors import ShardserveError

    with pytest.raises(ShardserveError, match="not found|no parquet files"):
        parquet_files(f"s3://{BUCKET}/nowhere/")
