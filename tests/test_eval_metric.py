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
    pq.write_table(pa.table({"emb": pa.FixedSizeListArray.from_arrays(flat, 16)}), directory / "a.parquet")
    return str(directory)


@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
def test_flat_index_scores_one_under_its_own_metric(varied_norms: str, tmp_path, metric: str) -> None:
    out = tmp_path / metric
    build_index(varied_norms, 2, "Flat", str(out), metric=metric, backend="local")
    result = evaluate(str(out), varied_norms, k=10)
    assert result["recall"] == pytest.approx(1.0), result
