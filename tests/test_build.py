"""The Ray Data build on a real local Ray + real FAISS: recall, sharding equivalence, determinism, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from index_build.job import BuildParams, build_from_dataset, build_index
from serving.evaluate import evaluate
from shardserve.data.datasets import load_dataset
from shardserve.errors import ShardserveError
from shardserve.index.manifest import pinned_location, read_manifest, read_version
from shardserve.index.storage import Location
from shardserve.query.searcher import load_all_shards
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def synthetic_index(ray_cluster, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("idx") / "syn"
    build_index("synthetic:20000x32", 4, "IVF64,Flat", str(out), backend="ray")
    return out


def test_manifest_follows_the_contract(synthetic_index: Path) -> None:
    manifest = json.loads((synthetic_index / "manifest.json").read_text())
    for key in ("format_version", "index_version", "dim", "metric", "index_factory", "num_vectors",
                "shards", "dataset", "build", "created_at"):
        assert key in manifest
    assert manifest["num_vectors"] == 20000 and len(manifest["shards"]) == 4
    assert sum(s["num_vectors"] for s in manifest["shards"]) == 20000
    assert {"ray_version", "faiss_version", "seconds", "params"} <= set(manifest["build"])
    assert sorted(p.name for p in synthetic_index.iterdir()) == ["manifest.json", "versions"]
    [version_dir] = (synthetic_index / "versions").iterdir()
    assert sorted(p.name for p in version_dir.iterdir()) == [
        "manifest.json", "shard-000.faiss", "shard-001.faiss", "shard-002.faiss", "shard-003.faiss",
        "trained.faiss"]
    assert {s["path"] for s in manifest["shards"]} == {f"versions/{version_dir.name}/shard-{n:03d}.faiss"
                                                        for n in range(4)}


def test_sharded_recall_equals_unsharded(synthetic_index: Path) -> None:
    result = evaluate(str(synthetic_index), "synthetic:20000x32", k=10, params={"nprobe": 4},
                      compare_unsharded=True)
    assert result["recall"] > 0.8
    assert result["recall"] == result["unsharded"]["recall"]  # shared quantizer: exactly equal


def test_ray_and_local_builds_are_byte_identical(synthetic_index: Path, tmp_path: Path) -> None:
    build_index("synthetic:20000x32", 4, "IVF64,Flat", str(tmp_path / "local"), backend="local")
    local, ray_built = (read_manifest(Location.parse(str(d))) for d in (tmp_path / "local", synthetic_index))
    for a, b in zip(local.shards, ray_built.shards, strict=True):
        assert (tmp_path / "local" / a.path).read_bytes() == (synthetic_index / b.path).read_bytes()
    assert read_manifest(Location.parse(str(tmp_path / "local"))).index_version == \
        read_manifest(Location.parse(str(synthetic_index))).index_version


def test_fashion_mnist_slice_via_cli(ray_cluster, tmp_path: Path) -> None:
    out = tmp_path / "fm"
    built = run_cli("build", "--dataset", "fashion-mnist", "--limit", "12000", "--shards", "4",
                    "--index", "IVF128,Flat", "--out", str(out))
    assert built.returncode == 0, built.stderr
    evaluated = run_cli("eval", str(out), "--dataset", "fashion-mnist", "--limit", "12000",
                        "--nprobe", "16", "--json", "--compare-unsharded")
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads(evaluated.stdout)
    assert result["queries"] == 10000 and result["k"] == 10 and result["qps"] > 0
    assert result["recall"] >= 0.98
    assert abs(result["recall"] - result["unsharded"]["recall"]) <= 0.005


@pytest.mark.parametrize("factory, params", [("HNSW16", ["--ef-search", "64"]),
                                             ("IVF32,Flat", ["--nprobe", "8"])])
def test_ann_benchmarks_angular_file(ray_cluster, angular_hdf5: Path, tmp_path: Path,
                                     factory: str, params: list[str]) -> None:
    out = tmp_path / "ang"
    built = run_cli("build", "--dataset", str(angular_hdf5), "--shards", "3", "--index", factory,
                    "--out", str(out))
    assert built.returncode == 0, built.stderr
    assert read_manifest(Location.parse(str(out))).metric == "cosine"
    evaluated = run_cli("eval", str(out), "--dataset", str(angular_hdf5), "--json", *params)
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["recall"] >= 0.95


def test_pq_factory_builds_and_searches(ray_cluster, tmp_path: Path) -> None:
    build_index("synthetic:8000x32", 2, "IVF32,PQ32x4fs", str(tmp_path / "pq"), backend="ray")
    result = evaluate(str(tmp_path / "pq"), "synthetic:8000x32", params={"nprobe": 8})
    assert 0.3 < result["recall"] <= 1.0


# --- bad input: one clear line, non-zero exit, nothing half-written --------------------------------

def _assert_clean_failure(result, message: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("shardserve: error:") and message in lines[-1], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--dataset", "nope"], "unknown dataset"),
    (["--dataset", "synthetic:1000x8", "--index", "IVF12x,Bogus"], "unknown index factory"),
    (["--dataset", "synthetic:1000x8", "--index", "IVF4096,Flat"], "training vectors"),
    (["--dataset", "synthetic:1000x8", "--shards", "0"], "--shards: must be >= 1"),
])
def test_bad_build_inputs(tmp_path: Path, args: list[str], message: str) -> None:
    base = {"--dataset": "synthetic:1000x8", "--index": "IVF8,Flat", "--shards": "2"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    out = tmp_path / "out"
    flags = [x for kv in base.items() for x in kv]
    result = run_cli("build", *flags, "--out", str(out), "--backend", "local")
    _assert_clean_failure(result, message)
    assert not out.exists() or list(out.iterdir()) == []


def _bad_files(directory: Path) -> dict[str, Path]:
    import h5py
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {"garbage.npy": b"not a numpy file", "garbage.parquet": b"PAR1garbagePAR1"}
    paths = {}
    for name, content in files.items():
        (directory / name).write_bytes(content)
        paths[name] = directory / name
    np.save(directory / "strings.npy", np.array([["a", "b"], ["c", "d"]]))
    np.save(directory / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(directory / "complex.npy", np.ones((100, 8), np.complex64))  # was silently truncated
    pq.write_table(pa.table({"v": [["a", "b"]] * 10}), directory / "strings.parquet")
    with h5py.File(directory / "neighbors.hdf5", "w") as handle:
        handle["train"] = np.ones((100, 8), np.float32)
        handle["test"] = np.ones((10, 8), np.float32)
        handle["neighbors"] = np.full((10, 5), 500)  # ids past the 100 train rows
    for name in ("strings.npy", "objects.npy", "complex.npy", "strings.parquet", "neighbors.hdf5"):
        paths[name] = directory / name
    return paths


@pytest.mark.parametrize("name, message", [
    ("garbage.npy", "not a numeric .npy array"), ("strings.npy", "expected real numbers"),
    ("objects.npy", "not a numeric .npy array"), ("complex.npy", "got complex64"),
    ("garbage.parquet", "cannot read parquet"), ("strings.parquet", "expected a list of numbers"),
    ("neighbors.hdf5", "'neighbors' holds ids outside [0, 100)"),
])
def test_bad_dataset_files_get_one_line_and_exit_2(tmp_path: Path, name: str, message: str) -> None:
    path = _bad_files(tmp_path)[name]
    out = tmp_path / "out"
    result = run_cli("build", "--dataset", str(path), "--shards", "2", "--index", "Flat",
                     "--out", str(out), "--backend", "local")
    _assert_clean_failure(result, message)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["serve", "IDX", "--replicas-per-shard", "0"], "--replicas-per-shard: must be >= 1, got 0"),
    (["deploy", "IDX", "--arg", "replicas_per_shard=2"], "replicas_per_shard: use --replicas-per-shard"),
    (["serve-config", "IDX", "--arg", "replicas_per_shard=0"], "use --replicas-per-shard"),
    (["serve-config", "IDX", "--arg", "max_k=0"], "--arg max_k: Input should be greater than or equal to 1"),
    (["deploy", "IDX", "--address", "127.0.0.1:9"], "no Ray cluster at 127.0.0.1:9"),
    (["eval", "IDX", "--dataset", "synthetic:20000x32", "--k", "zero"], "--k: expected an integer"),
])
def test_bad_flags_get_one_line_and_exit_2(synthetic_index: Path, args: list[str], message: str) -> None:
    result = run_cli(*[str(synthetic_index) if a == "IDX" else a for a in args], timeout=60)
    _assert_clean_failure(result, message)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_ray_task_and_disk_errors_read_as_one_line() -> None:
    """What the CLI prints for a failed Ray task (its cause, not the remote traceback) and a full disk."""
    import errno

    from ray.exceptions import RayTaskError

    from serving.cli import one_line

    failed = RayTaskError("add_shard", "Traceback (most recent call last):\n  ...", ValueError("bad rows"))
    assert one_line(failed) == "ValueError: bad rows"
    full = OSError(errno.ENOSPC, "No space left on device", "/idx/shard-001.faiss")
    assert one_line(full) == "No space left on device (/idx/shard-001.faiss)"
    assert one_line(RuntimeError("two\nlines")) == "RuntimeError: two lines"


def test_unwritable_out(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_cli("build", "--dataset", "synthetic:1000x8", "--shards", "2", "--index", "Flat",
                     "--out", str(blocker / "idx"))
    _assert_clean_failure(result, "not writable")


def test_nan_dataset_via_cli(tmp_path: Path) -> None:
    import numpy as np

    matrix = np.ones((200, 4), np.float32)
    matrix[7, 0] = np.inf
    np.save(tmp_path / "bad.npy", matrix)
    result = run_cli("build", "--dataset", str(tmp_path / "bad.npy"), "--shards", "2", "--index",
                     "Flat", "--out", str(tmp_path / "o"))
    _assert_clean_failure(result, "NaN/Inf")


def test_corrupt_shard_is_refused(synthetic_index: Path, tmp_path: Path) -> None:
    copy = tmp_path / "corrupt"
    shutil.copytree(synthetic_index, copy)
    shard = copy / read_manifest(Location.parse(str(copy))).shards[2].path
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = run_cli("eval", str(copy), "--dataset", "synthetic:20000x32")
    _assert_clean_failure(result, "sha256 mismatch")


def test_wrong_dimension_is_refused(synthetic_index: Path) -> None:
    result = run_cli("eval", str(synthetic_index), "--dataset", "synthetic:20000x16")
    _assert_clean_failure(result, "dim")


def test_existing_index_needs_force(synthetic_index: Path) -> None:
    result = run_cli("build", "--dataset", "synthetic:1000x8", "--shards", "2", "--index", "Flat",
                     "--out", str(synthetic_index), "--backend", "local")
    _assert_clean_failure(result, "--force")


def test_failure_mid_build_publishes_nothing(tmp_path: Path) -> None:
    class FailingOnThirdShard(Location):
        def write_bytes(self, relative: str, data: bytes) -> None:
            if relative == "shard-002.faiss":
                raise OSError("disk full (injected)")
            super().write_bytes(relative, data)

    plain = Location.parse(str(tmp_path / "idx"))
    location = FailingOnThirdShard(plain.fs, plain.root, plain.uri)
    location.ensure_writable()
    with pytest.raises(OSError, match="injected"):
        build_from_dataset(load_dataset("synthetic:4000x8"), BuildParams("IVF16,Flat", 4, "l2"),
                           location, backend="local")
    assert list((tmp_path / "idx").iterdir()) == []


def test_force_builds_beside_the_published_version_and_a_failed_rebuild_keeps_it(tmp_path: Path) -> None:
    """A published version is never changed: `--force` writes a new version directory and replaces
    only manifest.json; the old directory (what running replicas are bound to) stays byte-identical,
    and a rebuild that fails halfway leaves the published index exactly as it was."""
    out = tmp_path / "idx"
    build_index("synthetic:4000x8", 2, "IVF16,Flat", str(out), backend="local")
    first = pinned_location(str(out))
    first_files = {p.name: p.read_bytes() for p in Path(first).iterdir()}
    build_index("synthetic:4000x8", 3, "IVF16,Flat", str(out), backend="local", force=True, seed=5)
    second = pinned_location(str(out))
    assert second != first and len(read_manifest(Location.parse(second)).shards) == 3
    assert {p.name: p.read_bytes() for p in Path(first).iterdir()} == first_files
    assert len(read_manifest(Location.parse(first)).shards) == 2
    published_bytes = (out / "manifest.json").read_bytes()

    class FailingOnSecondShard(Location):
        def write_bytes(self, relative: str, data: bytes) -> None:
            if relative == "shard-001.faiss":
                raise OSError("disk full (injected)")
            super().write_bytes(relative, data)

    plain = Location.parse(str(out))
    with pytest.raises(OSError, match="injected"):
        build_from_dataset(load_dataset("synthetic:4000x8"), BuildParams("IVF16,Flat", 2, "l2", seed=9),
                           FailingOnSecondShard(plain.fs, plain.root, plain.uri), backend="local")
    assert (out / "manifest.json").read_bytes() == published_bytes
    assert sorted(p.name for p in (out / "versions").iterdir()) == sorted([Path(first).name,
                                                                            Path(second).name])
    _, searchers = load_all_shards(str(out))
    assert len(searchers) == 3


def test_a_replica_refuses_another_version_than_it_was_deployed_for(tmp_path: Path) -> None:
    out = tmp_path / "idx"
    built = build_index("synthetic:2000x8", 2, "Flat", str(out), backend="local")
    location = Location.parse(str(out))
    assert read_version(location, built.index_version).index_version == built.index_version
    with pytest.raises(ShardserveError, match="refusing to mix two indexes"):
        read_version(location, "0123456789abcdef")
