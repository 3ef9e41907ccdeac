"""Request parsing and validation (plain code, no server): every bad field names itself."""

import io
from collections.abc import AsyncIterator

import numpy as np
import orjson
import pytest

from shardserve.query.api import ApiError
from shardserve.query.merge import QueryResult
from shardserve.query.parse import check_work, is_npy, parse_npy_request, parse_search_request
from shardserve.query.render import coverage_error, render_search


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


@pytest.mark.parametrize("vector, message", [
    (["1.5", "2", "3", "4"], "numbers only"),          # numpy would have parsed these strings
    ([True, False, True, True], "numbers only"),       # ... and these booleans as 1.0 / 0.0
    ([1.0, None, 3.0, 4.0], "numbers only"),
    ([1e30, 1e30, 0.0, 0.0], "absurd magnitude"),      # finite in float32, its squared norm is not
])
def test_absurd_vectors_are_refused(vector: list, message: str) -> None:
    with pytest.raises(ApiError, match=message) as info:
        parse_search_request(orjson.dumps({"vector": vector}), 4, 100, 8)
    assert info.value.status == 422 and info.value.field == "vector"
    with pytest.raises(ApiError, match=message):
        parse_search_request(orjson.dumps({"vectors": [[1, 2, 3, 4], vector]}), 4, 100, 8)


def test_zero_vector_is_refused_under_cosine_only() -> None:
    body = orjson.dumps({"vector": [0, 0, 0, 0]})
    assert parse_search_request(body, 4, 100, 8, "l2").matrix.shape == (1, 4)
    with pytest.raises(ApiError, match="all zeros") as info:
        parse_search_request(body, 4, 100, 8, "cosine")
    assert info.value.status == 422


def test_work_per_request_is_bounded() -> None:
    query = parse_search_request(orjson.dumps({"vectors": [[1, 2, 3, 4]] * 8, "params": {"nprobe": 64}}),
                                 4, 100, 8)
    check_work(query, 512)  # 8 x 64 = 512: allowed
    with pytest.raises(ApiError, match="max_work 511") as info:
        check_work(query, 511)
    assert info.value.status == 422 and info.value.field == "params"


def test_read_body_stops_at_the_limit_without_reading_the_rest() -> None:
    import asyncio

    from shardserve.query.parse import read_body

    consumed = 0

    async def endless():
        nonlocal consumed
        while True:
            consumed += 1
            yield b"x" * 1000

    with pytest.raises(ApiError) as refused:
        asyncio.run(read_body(endless(), 10_000))
    assert refused.value.status == 413 and refused.value.field == "body"
    assert consumed == 11  # the chunk that crossed the limit was the last one read

    async def small():
        for part in (b'{"k": ', b"5}"):
            yield part

    assert asyncio.run(read_body(small(), 10_000)) == b'{"k": 5}'


def _result(answered: int, shards: int = 4, ids=((3, 1, -1),), distances=((0.5, 0.25, 3.4e38),)):
    return QueryResult(np.array(distances, np.float32), np.array(ids, np.int64), answered, shards,
                       compute_ms=1.5, fanout_ms=2.0, batch_size=7)


def test_coverage_decides_between_an_answer_and_a_503() -> None:
    one = _parse({"vector": [1, 2, 3, 4]})
    strict = _parse({"vector": [1, 2, 3, 4], "require_full": True})
    assert coverage_error(one, _result(4), 1) is None
    assert coverage_error(one, _result(2), 1) is None  # partial: answered, coverage says so
    none = coverage_error(one, _result(0), 2)
    assert (none.status, none.retry_after) == (503, 2)
    partial = coverage_error(strict, _result(3), 1)
    assert (partial.status, partial.field) == (503, "require_full") and "3 of 4" in partial.message


def test_render_keeps_real_hits_only_and_says_what_answered() -> None:
    body = orjson.loads(render_search(_parse({"vector": [1, 2, 3, 4]}), _result(3), 4.0, "v1"))
    assert body["ids"] == [3, 1] and body["distances"] == [0.5, 0.25]
    assert body["coverage"] == {"shards": 4, "answered": 3}
    assert body["timing_ms"] == {"total": 4.0, "compute": 1.5, "queue": 2.5}
    assert (body["index"], body["batch"]) == ("v1", 7)
    batch = _parse({"vectors": [[1, 2, 3, 4], [4, 3, 2, 1]]})
    rendered = orjson.loads(render_search(batch, _result(4, ids=((1, 2), (3, 4)),
                                                         distances=((0.1, 0.2), (0.3, 0.4))), 3.0, "v1"))
    assert [r["ids"] for r in rendered["results"]] == [[1, 2], [3, 4]]


@pytest.mark.parametrize("extra", [{}, {"require_full": True}])  # `true` in the body: row-by-row path
def test_both_parse_paths_give_the_same_matrix_and_the_same_refusals(extra: dict) -> None:
    rows = [[1, 2.5, -3, 4e-3], [0.1, 0.2, 0.3, 0.4]]
    parsed = parse_search_request(orjson.dumps({"vectors": rows, **extra}), 4, 100, 8)
    np.testing.assert_array_equal(parsed.matrix, np.array(rows, dtype=np.float32))
    assert parsed.matrix.dtype == np.float32
    for bad, message in [([[1, 2, 3, 4], [1, 2, 3]], "wrong dimension|dim 4"),
                         ([[1, 2, 3, 4], [[1, 2], 3, 4, 5]], "numbers only"),
                         ([[1, 2, 3, 4], ["a", 2, 3, 4]], "numbers only")]:
        with pytest.raises(ApiError, match=message) as info:
            parse_search_request(orjson.dumps({"vectors": bad, **extra}), 4, 100, 8)
        assert info.value.status == 422 and info.value.field == "vectors"


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=array.dtype.hasobject)  # a pickled body: refused unread
    return buffer.getvalue()


def test_npy_bodies_parse_to_what_the_same_json_parses_to() -> None:
    rng = np.random.default_rng(7)
    batch = rng.normal(size=(5, 8)).astype(np.float32)
    body = orjson.dumps({"vectors": batch.tolist(), "k": 3, "params": {"nprobe": 4}, "require_full": True,
                         "include": ["caption"]})
    want = parse_search_request(body, 8, 100, 1024)
    for array in (batch, batch.astype(np.float64), np.asfortranarray(batch)):
        got = parse_npy_request(_npy(array), "k=3&nprobe=4&require_full=true&include=caption", 8, 100, 1024)
        assert np.array_equal(got.matrix, want.matrix) and got.matrix.flags.c_contiguous
        assert (got.k, got.params, got.single, got.require_full, got.include) == \
               (want.k, want.params, want.single, want.require_full, want.include)
    one = parse_npy_request(_npy(batch[0]), "", 8, 100, 1024)
    assert one.single and one.matrix.shape == (1, 8) and one.k == 10 and one.params == ()


@pytest.mark.parametrize("body, query, field, message", [
    (b"not an array", "", "body", "not a .npy array"),
    (_npy(np.ones(8, np.float32))[:20], "", "body", "cut short"),
    (b"\x93NUMPY\x03\x00" + _npy(np.ones(8, np.float32))[8:], "", "body", "version 3"),
    (_npy(np.ones(8, np.float32)).replace(b"'<f4'", b"'<f3'"), "", "body", "not a .npy array"),
    (_npy(np.arange(16, dtype=np.int64).reshape(2, 8)), "", "body", "must hold floats"),
    (_npy(np.array([{"a": 1}], dtype=object)), "", "body", "must hold floats"),
    (_npy(np.zeros((2, 2, 8), np.float32)), "", "body", "(n, dim)"),
    (_npy(np.zeros((0, 8), np.float32)), "", "body", "non-empty"),
    (_npy(np.ones((2, 7), np.float32)), "", "vectors", "expected 8, got 7"),
    (_npy(np.ones((2000, 8), np.float32)), "", "vectors", "too many vectors"),
    (_npy(np.ones((2, 8), np.float32))[:-4], "", "body", "header says"),
    (_npy(np.array([np.nan] + [1.0] * 7, np.float32)), "", "vector", "NaN/Inf"),
    (_npy(np.full(8, 1e300)), "", "vector", "NaN/Inf"),
    (_npy(np.ones(8, np.float32)), "k=0", "k", "k must be an integer"),
    (_npy(np.ones(8, np.float32)), "k=ten", "k", "k must be an integer"),
    (_npy(np.ones(8, np.float32)), "k=%C2%B2", "k", "k must be an integer"),  # "²".isdigit() is true
    (_npy(np.ones(8, np.float32)), "nprobe=%D9%A3", "params.nprobe", "integer"),  # an Arabic-Indic 3
    (_npy(np.ones(8, np.float32)), "k=" + "9" * 5000, "k", "k must be an integer"),
    (_npy(np.ones(8, np.float32)), "nprobe=-1", "params.nprobe", "integer"),
    (_npy(np.ones(8, np.float32)), "colour=red", "colour", "unknown query option"),
    (_npy(np.ones(8, np.float32)), "require_full=maybe", "require_full", "true or false"),
])
def test_npy_refusals_name_the_field(body: bytes, query: str, field: str, message: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_npy_request(body, query, 8, 100, 1024)
    assert caught.value.status == 422 and caught.value.field == field and message in str(caught.value)


def test_content_type_picks_the_parser() -> None:
    assert is_npy("application/x-npy") and is_npy("Application/X-NPY; charset=binary")
    assert not is_npy("application/json") and not is_npy("")


def test_the_openapi_document_describes_npy_bodies() -> None:
    from shardserve.query.openapi import openapi_document

    search = openapi_document()["paths"]["/v1/search"]["post"]
    assert {"application/json", "application/x-npy"} <= set(search["requestBody"]["content"])
    assert {p["name"] for p in search["parameters"]} >= {"k", "nprobe", "include", "require_full"}


def test_the_openapi_document_describes_the_writes() -> None:
    from shardserve.query.openapi import openapi_document

    paths = openapi_document()["paths"]
    for route in ("/v1/upsert", "/v1/delete"):
        post = paths[route]["post"]
        assert {"application/json", "application/x-npy"} <= set(post["requestBody"]["content"])
        assert {"200", "422", "503", "501"} <= set(post["responses"])


@pytest.mark.parametrize("declared", ["\u00b2", "\u0663", "1" * 5000])
def test_a_content_length_of_non_ascii_digits_is_no_500(declared: str) -> None:
    """Only ASCII digits are a length: anything else is read as no length (the body is counted)."""
    import asyncio

    from shardserve.query.parse import receive_body

    async def chunks() -> AsyncIterator[bytes]:
        yield b"{}"

    if declared.isascii():
        with pytest.raises(ApiError) as caught:
            asyncio.run(receive_body(chunks(), declared, 1024, 1.0))
        assert caught.value.status == 413
    else:
        assert asyncio.run(receive_body(chunks(), declared, 1024, 1.0)) == b"{}"
