"""Recall is graded under the metric the index was built with, not the data file's default.

Parquet and .npy files carry no metric (their natural one is l2); a user who builds them with
`--metric cosine` (GloVe, most text embeddings) must get cosine ground truth. Vectors of very
different norms make the l2 and cosine neighbours differ, so a Flat index must score 1.0 only
when eval grades by its own metric. No Ray: the local build backend.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from index_build.job import build_index
from serving.evaluate import evaluate


@pytest.fixture(scope="module")
def varied_norms(tmp_path_factory) -> str:
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(4000, 16)).astype(np.float32)
    vectors *= rng.uniform(0.1, 10.0, size=(4000, 1)).astype(np.float32)  # l2 != cosine neighbours
    directory = tmp_path_factory.mktemp("varied") / "emb"
    directory.mkdir()
    flat = pa.array(vectors.ravel(), pa.float32())
    pq.write_table(pa.table({"emb": pa.FixedSizeListArray.from_arrays(flat, 16)}), directory / "a.parquet",
                   row_group_size=700)  # read in pieces: a streamed eval merges several chunks
    return str(directory)


@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
def test_flat_index_scores_one_under_its_own_metric(varied_norms: str, tmp_path, metric: str) -> None:
    out = tmp_path / metric
    build_index(varied_norms, 2, "Flat", str(out), metric=metric, backend="local")
    result = evaluate(str(out), varied_norms, k=10)
    assert result["recall"] == pytest.approx(1.0), result


@pytest.mark.parametrize(("metric", "factory", "params"),
                         [("l2", "IVF16,Flat", {"nprobe": 2}), ("cosine", "IVF16,Flat", {"nprobe": 2}),
                          ("ip", "Flat", {})])
def test_streamed_eval_equals_the_in_memory_eval(varied_norms: str, tmp_path, monkeypatch, metric: str,
                                                 factory: str, params: dict) -> None:
    """Ground truth brute-forced chunk by chunk (row groups of 700 of 4,000 rows, so several merge),
    the found rows' distances taken as the chunks pass: the same recall as with the data in memory,
    for an index that misses some neighbours (low nprobe) and one that misses none."""
    monkeypatch.setenv("SHARDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "index"
    build_index(varied_norms, 3, factory, str(out), metric=metric, backend="local")
    streamed = evaluate(str(out), varied_norms, k=10, params=params, stream=True)
    in_memory = evaluate(str(out), varied_norms, k=10, params=params, stream=False)
    assert streamed["recall"] == in_memory["recall"]
    assert streamed["queries"] == in_memory["queries"] == 1000  # rows of the 4,000, all indexed
    assert "streamed" in streamed["mode"] and "streamed" not in in_memory["mode"]
    if factory != "Flat":
        assert streamed["recall"] < 1.0  # the comparison saw misses
    # The streamed exact top-k is cached by fingerprint and metric: a second eval reuses it (a
    # cache entry holding other numbers would change the recall) and grades the same.
    cached = list((tmp_path / "cache" / "groundtruth").glob(f"*-{metric}-k100-distances.npy"))
    assert len(cached) == 1
    assert evaluate(str(out), varied_norms, k=10, params=params, stream=True)["recall"] == streamed["recall"]
    truth = np.load(cached[0])
    np.save(cached[0], np.full_like(truth, -1e9 if metric == "l2" else 1e9))  # nothing is that near
    assert evaluate(str(out), varied_norms, k=10, params=params, stream=True)["recall"] == 0.0


def test_exact_search_in_chunks_equals_one_flat_scan() -> None:
    import faiss

    from shardserve.data.groundtruth import exact_search
    from shardserve.index.indexes import FAISS_METRIC, prepare_vectors

    rng = np.random.default_rng(5)
    base, queries = rng.normal(size=(3000, 8)).astype(np.float32), rng.normal(size=(50, 8)).astype(np.float32)
    for metric in ("l2", "cosine"):
        index = faiss.IndexFlat(8, FAISS_METRIC[metric])
        index.add(prepare_vectors(base, metric))
        want_d, want_i = index.search(prepare_vectors(queries, metric), 10)
        got_d, got_i = exact_search(base, queries, 10, metric, chunk_rows=333)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_allclose(got_d, want_d, rtol=1e-5)
