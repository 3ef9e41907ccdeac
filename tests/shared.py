"""Test data more than one test file uses: seeded, small, real (no mocks), built here once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardserve.data.datasets import load_dataset
from shardserve.index.indexes import add_to_copy, train_empty_index
from shardserve.query.searcher import ShardSearcher

ROWS, DIM, FILES = 6000, 16, 3


def source_id(row: np.ndarray) -> np.ndarray:
    """The id the source gives row r: sparse and large, nothing like a row number."""
    return row.astype(np.int64) * 1_000_003 + 2**40


def write_parquet(directory: Path, ids: np.ndarray | None = None, id_type: pa.DataType | None = None) -> Path:
    """FILES parquet files: `emb` (list<float32>, component 0 = the source row), `doc_id`, `caption`."""
    rng = np.random.default_rng(7)
    centers = rng.normal(size=(32, DIM)).astype(np.float32)
    vectors = centers[rng.integers(0, 32, ROWS)] + 0.1 * rng.normal(size=(ROWS, DIM)).astype(np.float32)
    vectors[:, 0] = np.arange(ROWS)  # lets a test find the source row of any base row
    ids = source_id(np.arange(ROWS)) if ids is None else ids
    directory.mkdir(parents=True, exist_ok=True)
    for number, rows in enumerate(np.array_split(np.arange(ROWS), FILES)):
        table = pa.table({
            "emb": pa.array(list(vectors[rows]), type=pa.list_(pa.float32())),
            "doc_id": pa.array(ids[rows]).cast(id_type or pa.int64()),
            "caption": pa.array([f"caption {r}" for r in rows]),
        })
        pq.write_table(table, directory / f"part-{number:02d}.parquet")
    return directory


def shards(num: int = 3) -> tuple:
    """A synthetic dataset and `num` row-dealt shards of one trained IVF16,Flat index."""
    data = load_dataset("synthetic:3000x16")
    empty = train_empty_index("IVF16,Flat", "l2", data.base, seed=1)
    ids = np.arange(len(data.base))
    searchers = [ShardSearcher(add_to_copy(empty, data.base[s::num], ids[s::num]), "l2", f"s{s}", "v")
                 for s in range(num)]
    return data, searchers



# HTTP requests whose framing two parsers could read two ways (tests of the door and of the edge).
_CHUNKED = b"POST /v1/search HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"
# Requests whose framing two parsers could read two ways: each must get one 400-class answer and a
# closed connection, never an answer to the request hidden behind it.
SMUGGLING = {
    "content-length and transfer-encoding": b"POST /v1/search HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
                                            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "transfer-encoding then content-length": b"POST /v1/search HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: "
                                             b"chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n",
    "duplicate content-length": b"POST /v1/search HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n"
                                b"Content-Length: 40\r\n\r\n",
    "signed content-length": b"POST /v1/search HTTP/1.1\r\nHost: a\r\nContent-Length: +0\r\n\r\n",
    "bare LF ending a header": b"POST /v1/search HTTP/1.1\r\nHost: a\nContent-Length: 40\r\n\r\n",
    "bare LF everywhere": b"POST /v1/search HTTP/1.1\nHost: a\nContent-Length: 0\n\n",
    "obs-fold": b"POST /v1/search HTTP/1.1\r\nHost: a\r\nX-A: b\r\n Content-Length: 40\r\n\r\n",
    "space before colon": b"POST /v1/search HTTP/1.1\r\nHost: a\r\nContent-Length : 40\r\n\r\n",
    "chunk size 0x": _CHUNKED + b"0x0\r\n\r\n",
    "chunk size +": _CHUNKED + b"+0\r\n\r\n",
    "chunk size -": _CHUNKED + b"-1\r\nx\r\n0\r\n\r\n",
    "chunk size _": _CHUNKED + b"1_0\r\n\r\n",
    "chunk size space": _CHUNKED + b" 0\r\n\r\n",
    "chunk data without CRLF": b"POST /v1/search HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                               b"1\r\nxYY0\r\n\r\n",
    "transfer-encoding list": b"POST /v1/search HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, "
                              b"chunked\r\n\r\n0\r\n\r\n",
    "transfer-encoding twice": b"POST /v1/search HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
                               b"Transfer-Encoding: identity\r\n\r\n0\r\n\r\n",
    "NUL in a header": b"POST /v1/search HTTP/1.1\r\nHost: a\x00\r\nContent-Length: 0\r\n\r\n",
}


def sharded_and_unsharded(factory: str, metric: str, base: np.ndarray, shards: int = 4,
                          by: str = "ivf-lists") -> tuple:
    """Shards dealt as the build deals them (whole IVF lists per shard), or by row (i mod S), the
    unsharded index of the same rows, and the router's assigner (None: not IVF)."""
    from index_build.job import rows_per_shard
    from shardserve.index.assigner import CoarseAssigner
    from shardserve.index.indexes import index_from_bytes, prepare_vectors
    from shardserve.index.partition import BY_LISTS, Partition

    vectors = prepare_vectors(base, metric)
    empty = train_empty_index(factory, metric, vectors, seed=3)
    ids = np.arange(len(vectors))
    partition = Partition.plan(empty, vectors, shards) if by == BY_LISTS else Partition(shards)
    assert partition.kind == by
    searchers = [ShardSearcher(add_to_copy(empty, vectors[rows], ids[rows]), metric, f"s{s}", "v")
                 for s, rows in enumerate(rows_per_shard(partition, empty, vectors))]
    unsharded = ShardSearcher(add_to_copy(empty, vectors, ids), metric, "all", "v")
    return searchers, unsharded, CoarseAssigner.from_trained(index_from_bytes(empty))
