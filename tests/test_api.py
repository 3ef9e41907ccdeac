"""Request parsing and validation (plain code, no server): every bad field names itself."""

import numpy as np
import orjson
import pytest

from serving.api import ApiError, parse_search_request


def _parse(payload: object, dim: int = 4):
    return parse_search_request(orjson.dumps(payload), dim=dim, max_k=100, max_vectors=8)


def test_single_and_batch() -> None:
    single = _parse({"vector": [1, 2, 3, 4], "k": 3, "params": {"nprobe": 8}})
    assert single.single and single.matrix.shape == (1, 4) and single.matrix.dtype == np.float32
    assert single.params == (("nprobe", 8),) and single.k == 3
    batch = _parse({"vectors": [[1, 2, 3, 4]] * 3})
    assert not batch.single and batch.matrix.shape == (3, 4) and batch.k == 10


@pytest.mark.parametrize("payload, field", [
    ({"vector": [1, 2, 3]}, "vector"),
    ({"vector": [1, 2, 3, "x"]}, "vector"),
    ({"vectors": [[1, 2, 3, 4], [1, 2]]}, "vectors"),
    ({"vectors": []}, "vectors"),
    ({"vectors": [[1, 2, 3, 4]] * 9}, "vectors"),
    ({"vector": [1, 2, 3, 4], "k": 0}, "k"),
    ({"vector": [1, 2, 3, 4], "k": 101}, "k"),
    ({"vector": [1, 2, 3, 4], "k": "5"}, "k"),
    ({"vector": [1, 2, 3, 4], "params": {"nlist": 3}}, "params.nlist"),
    ({"vector": [1, 2, 3, 4], "params": {"nprobe": -1}}, "params.nprobe"),
    ({"vector": [1, 2, 3, 4], "extra": 1}, "extra"),
    ({"k": 3}, "vector"),
    ({"vector": [1e39, 0, 0, 0]}, "vector"),
    ([1, 2], "body"),
])
def test_bad_fields_are_named(payload: object, field: str) -> None:
    with pytest.raises(ApiError) as info:
        _parse(payload)
    assert info.value.status == 422 and info.value.field == field


def test_nan_is_refused() -> None:
    with pytest.raises(ApiError, match="NaN"):
        parse_search_request(b'{"vector": [1, NaN, 3, 4]}', 4, 100, 8)
