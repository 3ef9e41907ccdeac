"""The half-precision scan served through real Serve over HTTP: shards whose lists outgrow a core's
cache scan their copy, and the answers are FAISS's own float32 answers; a deleted id stays gone and
an upserted vector is found, through the same path."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from index_build.job import build_index
from shardserve.client import Client
from shardserve.data.datasets import load_dataset
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location
from shardserve.query.searcher import ShardSearcher, load_all_shards
from tests.conftest import SERVE_PORT as PORT

pytestmark = pytest.mark.slow
LIMIT = 20000  # 16 lists of ~1,250 Fashion-MNIST images: ~3.9 MB each in float32


def test_served_answers_are_faiss_float32_answers(ray_cluster, tmp_path: Path) -> None:
    from deployments.run import deploy, undeploy

    index = str(tmp_path / "idx")
    build_index("fashion-mnist", 2, "IVF16,Flat", index, limit=LIMIT, backend="local")
    location, manifest = Location.parse(index), read_manifest(Location.parse(index))
    # the copy is made where the lists outgrow this machine's core cache, as they do here (a
    # searcher loaded as a replica loads it)
    assert all(ShardSearcher.load(location, manifest, shard).half is not None for shard in range(2))
    _, shards = load_all_shards(index, mmap=False)  # float32 only, merged: FAISS's own answers
    unsharded = faiss.clone_index(shards[0].index)
    unsharded.merge_from(shards[1].index, 0)
    queries = load_dataset("fashion-mnist", num_queries=100).queries
    params = faiss.SearchParametersIVF(nprobe=4)
    expected_d, expected_i = unsharded.search(queries, 10, params=params)
    url = deploy(index, port=PORT, app_name="half", route_prefix="/half", shard_num_cpus=0.1,
                 router_num_cpus=0.1, warm_workers=0)
    try:
        with Client(url) as client:
            hits = client.search_batch(queries, 10, {"nprobe": 4})
            assert np.array_equal(np.stack([h.ids for h in hits]), expected_i)
            # float32 through JSON and back (orjson writes a float32's shortest form): the same bits
            assert np.array_equal(np.stack([h.distances for h in hits]), expected_d)

            gone = int(expected_i[0, 0])
            client.delete([gone])
            after = client.search(queries[0], 10, {"nprobe": 4})
            assert gone not in after.ids.tolist()
            deleted = faiss.IDSelectorBatch(np.array([gone]))
            kept = faiss.IDSelectorNot(deleted)  # reads `deleted`: both held until FAISS returns
            without = faiss.SearchParametersIVF(nprobe=4, sel=kept)
            _, remaining_i = unsharded.search(queries[:1], 10, params=without)
            assert after.ids.tolist() == remaining_i[0].tolist()

            new = 10**12
            client.upsert([new], queries[1][None])  # at distance 0 from the query
            assert client.search(queries[1], 3, {"nprobe": 4}).ids[0] == new
    finally:
        undeploy("half")
