"""Every index type serves over real Serve HTTP with its own params: Flat, HNSW32 (efSearch) and
IVF-PQ fast-scan with a refine step (nprobe). Non-IVF indexes once crashed the router."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from index_build.job import build_index
from serving.evaluate import evaluate
from tests.conftest import SERVE_PORT as PORT

pytestmark = pytest.mark.slow
LIMIT = 20000
QUERIES = 1000  # of Fashion-MNIST's 10,000: recall within a point or so of all of them


@pytest.mark.parametrize("factory, params", [
    ("Flat", {}),
    pytest.param("HNSW32", {"efSearch": 64}, marks=pytest.mark.release),  # Flat is the non-IVF case in CI
    ("IVF256,PQ98x4fs,RFlat", {"nprobe": 16}),
])
def test_index_type_serves_with_recall(ray_cluster, tmp_path: Path, factory: str, params: dict) -> None:
    from deployments.run import deploy, undeploy

    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, factory, str(index), limit=LIMIT, backend="local")
    url = deploy(str(index), port=PORT, app_name="types", route_prefix="/types",
                 shard_num_cpus=0.1, router_num_cpus=0.1)
    # Over HTTP, eval needs the manifest only: a copy without the shard files grades the same.
    manifests_only = tmp_path / "manifests-only"
    shutil.copytree(index, manifests_only)
    for path in manifests_only.rglob("*"):
        if path.is_file() and path.name != "manifest.json":
            path.unlink()
    try:
        result = evaluate(str(manifests_only), "fashion-mnist", k=10, params=params, url=url, limit=LIMIT,
                          num_queries=QUERIES)
        # Fashion-MNIST's labels as filters over HTTP, graded against brute force over the matching
        # rows: five classes (50 %, a widened scan), a class (10 %), a class within the first 2,000
        # and 200 ids (~1 % and ~0.1 %; these three compared row by row)
        filtered = [evaluate(str(manifests_only), "fashion-mnist", k=10, params=params, url=url, limit=LIMIT,
                             where=where, num_queries=QUERIES)
                    for where in ({"label": {"$in": [1, 3, 5, 7, 9]}}, {"label": 3},
                                  {"label": 3, "$id": {"$lt": LIMIT // 10}},
                                  {"label": 3, "$id": {"$lt": LIMIT // 100}})]
    finally:
        undeploy("types")
    assert result["recall"] >= 0.95, result
    assert result["shards"] == 2
    assert [round(f["matching_rows"] / LIMIT, 3) for f in filtered] == pytest.approx([0.5, 0.1, 0.01, 0.001],
                                                                                     rel=0.2)
    assert all(f["recall"] >= 0.95 for f in filtered), filtered
