"""Shared fixtures: a real local Ray owned by the test session, small real datasets on disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardserve.runtime.ports import free_port
from shardserve.runtime.ray_session import SERVING_NODE_ENV, shutdown_ray

REPO = Path(__file__).resolve().parent.parent
# Before any test imports ray.serve: Serve reads these flags at import time (driver and cluster
# must agree).
os.environ.update(SERVING_NODE_ENV)
# Serve keeps a deleted app's ingress replica up this long so HAProxy stops routing to it (30 s by
# default); the tests delete many apps whose routes nobody else uses.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
# tests/test_s3.py's loopback S3 server listens on S3_PORT. Its endpoint and keys enter the
# environment now, before the session's Ray starts, so Ray's workers (build tasks reading and
# writing s3://) get them from their node as the driver does: a cluster set up that way.
S3_PORT = free_port()
# The Serve HTTP port of every test cluster: one per cluster, so every test that deploys uses it.
SERVE_PORT = 18321
os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}", "AWS_ACCESS_KEY_ID": "test",
                   "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                   "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})


# A test that uses Ray or starts a server carries one of these: `make test-fast` deselects them.
HEAVY = {"slow", "cluster", "ha", "release"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for the session's Ray must say so with a marker."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()) and not _heavy(item):
            raise pytest.UsageError(f"{item.nodeid} uses ray_cluster: mark it slow")


def _heavy(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in HEAVY)


@pytest.fixture(autouse=True)
def _ray_needs_a_marker(request: pytest.FixtureRequest):
    """A test without a heavy marker that starts Ray in this process fails: it would run in
    `make test-fast`, and leave a Ray behind for the tests after it."""
    ray = sys.modules.get("ray")
    before = bool(ray and ray.is_initialized())
    yield
    ray = sys.modules.get("ray")
    if not _heavy(request.node) and not before and ray is not None and ray.is_initialized():
        pytest.fail(f"{request.node.nodeid} started Ray: mark it slow", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["SHARDSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray with the fast Serve ingress settings; shut down when the session ends."""
    import ray

    os.environ.update(SERVING_NODE_ENV)
    os.environ.pop("RAY_ADDRESS", None)
    # HAProxy's stats/metrics ports default to fixed 8404/9101: this cluster takes free ones, so a
    # cluster another test (or a user) runs on this machine never races it for them; outside the
    # ephemeral range, so no other process is handed them before HAProxy binds them (runtime.ports).
    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        os.environ[name] = str(free_port())
    # 4 logical CPUs on 2 cores: tests run extra small apps beside the main one (slow shard, late
    # shard); Serve replicas reserve fractions of a CPU, not cores.
    # Metrics reach Ray's export every 2 s instead of 10 s: the dashboard tests read them sooner.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 2000})
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    finally:
        shutdown_ray()


@pytest.fixture(scope="session")
def small_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fashion-MNIST's first 5,000 images in a 2-shard IVF64,Flat index, built once for every test
    that only reads it (each deploys its own app on it: a fault-injected shard, a door-only router, a
    bystander). Read-only, on disk too: a write would need the write log beside its manifest."""
    from index_build.job import build_index

    index = tmp_path_factory.mktemp("small") / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="local")
    for folder in sorted(index.rglob("*"), reverse=True) + [index]:
        if folder.is_dir():
            folder.chmod(0o555)
    return index


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real `shardserve` console script (the way users do)."""
    exe = Path(sys.executable).parent / "shardserve"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "RAY_ADDRESS": ""})


@pytest.fixture(scope="session")
def angular_hdf5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ann-benchmarks layout file (train/test/neighbors, distance=angular) written by the test."""
    import h5py

    from shardserve.data.datasets import synthetic_vectors
    from shardserve.data.groundtruth import exact_search

    train = synthetic_vectors(6000, 32, seed=11)
    test = synthetic_vectors(200, 32, seed=12)
    _, neighbors = exact_search(train, test, 100, "cosine")
    path = tmp_path_factory.mktemp("annb") / "toy-32-angular.hdf5"
    with h5py.File(path, "w") as handle:
        handle.attrs["distance"] = "angular"
        handle.create_dataset("train", data=train)
        handle.create_dataset("test", data=test)
        handle.create_dataset("neighbors", data=neighbors.astype(np.int32))
    return path
