"""Write bodies (`POST /v1/upsert`, `POST /v1/delete`): validated into operations, or a 422 naming
the field, for the whole request. No server: the parser alone."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pytest

from shardserve.index.manifest import DatasetInfo, Manifest
from shardserve.query.api import ApiError
from shardserve.query.filters import check_filter
from shardserve.query.parse import parse_npy_request
from shardserve.writes.accept import WriteFront, WriteTrace, delete_matching
from shardserve.writes.follow import READ_REQUESTS
from shardserve.writes.locate import open_log
from shardserve.writes.log import LogMoved, WriteLog
from shardserve.writes.ops import MAX_ID, Delete, Upsert
from shardserve.writes.parse import (
    MAX_METADATA_BYTES,
    MAX_STRING_BYTES,
    delete_filter,
    parse_delete,
    parse_delete_npy,
    parse_upsert,
    parse_upsert_npy,
)
from shardserve.writes.roll import Carried, gathered, metadata_schema

DIM = 4
KINDS = {"label": "uint8", "big": "int64", "score": "number", "lang": "string", "ok": "bool"}
V = [0.5, 1.0, -2.0, 3.0]


def upsert(payload: dict | bytes, metric: str = "l2", max_points: int = 10) -> list[Upsert]:
    body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return parse_upsert(body, DIM, metric, KINDS, max_points)


def test_a_valid_upsert_and_delete() -> None:
    ops = upsert({"ids": [0, 7, MAX_ID], "vectors": [V, V, [0, 0, 0, 1]],
                  "metadata": [{"label": 255, "big": 2**62 + 1, "score": 2, "lang": "de", "ok": True},
                               None, {"label": 3.0, "lang": None}]})
    assert [op.id for op in ops] == [0, 7, MAX_ID]
    assert ops[0].metadata == {"label": 255, "big": 2**62 + 1, "score": 2.0, "lang": "de", "ok": True}
    assert ops[1].metadata is None and ops[2].metadata == {"label": 3, "lang": None}
    assert ops[0].vector.dtype == np.float32 and ops[0].vector.tolist() == V
    assert [op.metadata for op in upsert({"ids": [1], "vectors": [V]})] == [None]  # metadata optional
    cosine = upsert({"ids": [1], "vectors": [[3, 0, 4, 0]]}, metric="cosine")
    assert np.allclose(cosine[0].vector, [0.6, 0, 0.8, 0])  # stored as the index stores it
    assert parse_delete(b'{"ids": [3, 0]}', 10) == [Delete(3), Delete(0)]


TOO_MANY = {"ids": list(range(11)), "vectors": [V] * 11}


@pytest.mark.parametrize(("payload", "field", "says"), [
    # ids
    ({"vectors": [V]}, "ids", "non-empty list"),
    ({"ids": [], "vectors": []}, "ids", "non-empty list"),
    ({"ids": 3, "vectors": [V]}, "ids", "non-empty list"),
    ({"ids": [-1], "vectors": [V]}, "ids", "outside [0,"),
    ({"ids": [2**63], "vectors": [V]}, "ids", "outside [0,"),
    (b'{"ids": [18446744073709551621], "vectors": [[1, 2, 3, 4]]}', "ids", "JSON integer"),  # a float
    ({"ids": [1.0], "vectors": [V]}, "ids", "JSON integer"),
    ({"ids": [True], "vectors": [V]}, "ids", "JSON integer"),
    ({"ids": ["1"], "vectors": [V]}, "ids", "JSON integer"),
    ({"ids": [4, 5, 4], "vectors": [V] * 3}, "ids", "appears twice"),
    (TOO_MANY, "ids", "too many points: 11 > max 10"),
    # vectors
    ({"ids": [1]}, "vectors", "required"),
    ({"ids": [1, 2], "vectors": [V]}, "vectors", "aligned with ids"),
    ({"ids": [1], "vectors": [[1.0, 2.0]]}, "vectors", "wrong dimension: expected 4, got 2"),
    ({"ids": [1, 2], "vectors": [V, [1.0, 2.0]]}, "vectors", "dim 4"),
    ({"ids": [1], "vectors": [[1, 2, 3, "4"]]}, "vectors", "numbers only"),
    ({"ids": [1], "vectors": [[1, 2, 3, True]]}, "vectors", "numbers only"),
    (b'{"ids": [1], "vectors": [[1, 2, 3, NaN]]}', "vectors", "NaN/Infinity"),
    (b'{"ids": [1], "vectors": [[1, 2, 3, Infinity]]}', "vectors", "NaN/Infinity"),
    (b'{"ids": [1], "vectors": [[1, 2, 3, 1e400]]}', "vectors", "NaN/Infinity"),
    ({"ids": [1], "vectors": [[1e39, 0, 0, 0]]}, "vectors", "NaN/Inf"),  # beyond float32
    ({"ids": [1], "vectors": [[1e30, 0, 0, 0]]}, "vectors", "absurd magnitude"),
    ({"ids": [1], "vectors": V}, "vectors", "aligned with ids: 1 ids, 4"),  # a vector, not a list
    # metadata
    ({"ids": [1, 2], "vectors": [V, V], "metadata": [{}]}, "metadata", "aligned with ids: 2 entries"),
    ({"ids": [1], "vectors": [V], "metadata": {"label": 1}}, "metadata", "aligned with ids"),
    ({"ids": [1], "vectors": [V], "metadata": [3]}, "metadata", "object or null"),
    ({"ids": [1], "vectors": [V], "metadata": [{"colour": "red"}]}, "metadata", "unknown column 'colour'"),
    ({"ids": [1], "vectors": [V], "metadata": [{"label": 256}]}, "metadata", "outside the uint8"),
    ({"ids": [1], "vectors": [V], "metadata": [{"label": -1}]}, "metadata", "outside the uint8"),
    ({"ids": [1], "vectors": [V], "metadata": [{"label": "3"}]}, "metadata", "needs an integer"),
    ({"ids": [1], "vectors": [V], "metadata": [{"label": True}]}, "metadata", "needs an integer"),
    ({"ids": [1], "vectors": [V], "metadata": [{"label": 1.5}]}, "metadata", "needs an integer"),
    ({"ids": [1], "vectors": [V], "metadata": [{"big": 2.0**60}]}, "metadata", "past 2^53"),
    ({"ids": [1], "vectors": [V], "metadata": [{"big": 2**63}]}, "metadata", "outside the int64"),
    ({"ids": [1], "vectors": [V], "metadata": [{"score": "high"}]}, "metadata", "needs a number"),
    ({"ids": [1], "vectors": [V], "metadata": [{"score": False}]}, "metadata", "needs a number"),
    ({"ids": [1], "vectors": [V], "metadata": [{"lang": 3}]}, "metadata", "needs a string"),
    ({"ids": [1], "vectors": [V], "metadata": [{"ok": 1}]}, "metadata", "needs a bool"),
    # the body
    (b'{"ids": [1], "vectors": [V]', "body", "not valid JSON"),
    (b'[1, 2]', "body", "JSON object"),
    ({"ids": [1], "vectors": [V], "wait": False}, "wait", "unknown field"),
])
def test_bad_upserts_are_422_naming_the_field(payload: dict | bytes, field: str, says: str) -> None:
    with pytest.raises(ApiError) as refused:
        upsert(payload)
    assert (refused.value.status, refused.value.field) == (422, field), refused.value.message
    assert says in refused.value.message


def test_a_zero_vector_is_refused_under_cosine_only() -> None:
    zero = {"ids": [1], "vectors": [[0, 0, 0, 0]]}
    assert len(upsert(zero)) == 1
    with pytest.raises(ApiError, match="all zeros") as refused:
        upsert(zero, metric="cosine")
    assert refused.value.field == "vectors"


def test_one_bad_point_refuses_the_whole_request() -> None:
    """The parser answers for the request: no operation of it comes out to be logged."""
    good = [V] * 5
    with pytest.raises(ApiError):
        upsert({"ids": [1, 2, 3, 4, 5], "vectors": good, "metadata": [None] * 4 + [{"label": 999}]})


@pytest.mark.parametrize(("body", "says"), [
    (b'{"ids": []}', "non-empty list"),
    (b'{"ids": [1, 1]}', "appears twice"),
    (b'{"ids": [-3]}', "outside [0,"),
    (b'{"ids": [9223372036854775808]}', "outside [0,"),
    (b'{"ids": [1.5]}', "JSON integer"),
    (b'{"ids": [1, 2, 3]}', "too many points"),
])
def test_bad_deletes_are_422_naming_ids(body: bytes, says: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_delete(body, 2)
    assert (refused.value.status, refused.value.field) == (422, "ids") and says in refused.value.message


def test_a_delete_takes_ids_only() -> None:
    with pytest.raises(ApiError) as refused:
        parse_delete(b'{"ids": [1], "vectors": [[1, 2, 3, 4]]}', 10)
    assert refused.value.field == "vectors" and "unknown field" in refused.value.message


def npy(*arrays: object) -> bytes:
    """Arrays saved one after the other, as a .npy write body holds them."""
    out = b""
    for array in arrays:
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(array), allow_pickle=False)
        out += buffer.getvalue()
    return out


def test_an_npy_upsert_is_the_json_upsert() -> None:
    """The ids array then the vectors array: the same operations as the JSON body, whatever the
    ids' integer width or the vectors' float width; a delete's body is the ids alone."""
    vectors = np.array([V, [0, 0, 0, 1], [1, 2, 3, 4]], np.float64)
    json_ops = upsert({"ids": [0, 7, MAX_ID], "vectors": vectors.tolist()}, metric="cosine")
    for ids in (np.array([0, 7, MAX_ID], np.int64), np.array([0, 7, MAX_ID], np.uint64)):
        ops = parse_upsert_npy(npy(ids, vectors), DIM, "cosine", 10)
        assert [op.id for op in ops] == [0, 7, MAX_ID] and all(type(op.id) is int for op in ops)
        for mine, theirs in zip(ops, json_ops, strict=True):
            assert mine.metadata is None and mine.vector.dtype == np.float32
            assert mine.vector.tobytes() == theirs.vector.tobytes()
    assert [op.id for op in parse_upsert_npy(npy(np.array([5], np.uint8), np.array(V, np.float32)),
                                             DIM, "l2", 10)] == [5]  # one point: a (dim,) vector
    assert parse_delete_npy(npy(np.array([3, 1], np.int32)), 10) == [Delete(3), Delete(1)]


@pytest.mark.parametrize(("body", "field", "says"), [
    (b"not npy", "body", "not a .npy array"),
    (npy(np.array([1.0]), np.array([V])), "ids", "must hold integers"),
    (npy(np.array([[1]]), np.array([V])), "ids", "must be (n,)"),
    (npy(np.zeros(0, np.int64), np.zeros((0, DIM))), "ids", "must be (n,) and non-empty"),
    (npy(np.arange(11), np.zeros((11, DIM))), "ids", "too many points"),
    (npy(np.array([-1]), np.array([V])), "ids", "outside"),
    (npy(np.array([2**63], np.uint64), np.array([V])), "ids", "outside"),
    (npy(np.array([4, 2, 4]), np.array([V, V, V])), "ids", "ids[2] = 4 appears twice"),
    (npy(np.array([1])), "vectors", "vectors is required"),
    (npy(np.array([1, 2]), np.array([V])), "vectors", "aligned with ids: 2 ids, 1 vectors"),
    (npy(np.array([1]), np.array([V + [0.0]])), "vectors", "wrong dimension"),
    (npy(np.array([1]), np.array([[np.nan, 0, 0, 0]])), "vectors", "NaN"),
    (npy(np.array([1]), np.array(["a", "b", "c", "d"])), "body", "must hold floats"),
    (npy(np.array([1]), np.array([V]))[:-3], "body", "data is"),
    (npy(np.array([1, 2]))[:-4], "body", "cut short"),
])
def test_bad_npy_upserts_are_422_naming_the_field(body: bytes, field: str, says: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_upsert_npy(body, DIM, "l2", 10)
    assert refused.value.status == 422 and refused.value.field == field and says in refused.value.message


def test_mangled_npy_write_bodies_are_422_or_parse_never_anything_else() -> None:
    """Bytes flipped, cut and repeated anywhere in valid .npy write bodies (and in the vectors
    array alone, as a search's body): every one parses, or is a 422; no other exception, nothing
    unpickled (a cut header once raised tokenize's TokenError through NumPy's header reader)."""
    rng = np.random.default_rng(11)
    good = npy(np.array([1, 2, 3], np.int64), np.ones((3, DIM), np.float32))
    outcomes = set()
    for trial in range(3000):
        body = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, len(body)))
            kind = trial % 3
            if kind == 0:
                body[at] = int(rng.integers(0, 256))
            elif kind == 1:
                del body[at:]
                break
            else:
                body[at:at] = body[at:at + int(rng.integers(1, 16))]
        for parse in (lambda b: parse_upsert_npy(b, DIM, "l2", 10), lambda b: parse_delete_npy(b, 10),
                      lambda b: parse_npy_request(b[b.index(b"\x93NUMPY", 1):] if b.count(b"\x93NUMPY") > 1
                                                  else b, "", DIM, 10, 10)):  # a search's: the vectors
            try:
                parse(bytes(body))
                outcomes.add("parsed")
            except ApiError as refused:
                assert refused.status == 422
                outcomes.add("422")
    assert outcomes == {"parsed", "422"}


_HEADER = "{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}"


def _raw_npy(header: str, data: bytes) -> bytes:
    """A version 1.0 .npy body with a header written by hand (NumPy's writer refuses these)."""
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


@pytest.mark.parametrize("body", [
    _raw_npy(_HEADER.format("<i8", "(-1,)"), b"\0" * 12),
    _raw_npy(_HEADER.format("<i8", "(-1,)"), b"\0" * 16_000_000),
    npy(np.array([1])) + _raw_npy(_HEADER.format("<f4", "(-1, -4)"), b"\0" * 16),
    npy(np.array([1])) + _raw_npy(_HEADER.format("<f4", "(-2, -2)"), b"\0" * 16),
])
def test_negative_npy_shapes_are_422_before_any_data_is_read(body: bytes) -> None:
    """NumPy's header reader takes a negative size; read as one it would take the whole body as
    ids (the limit skipped) or end in reshape's ValueError, a 500."""
    for parse in (lambda b: parse_upsert_npy(b, DIM, "l2", 10), lambda b: parse_delete_npy(b, 10),
                  lambda b: parse_npy_request(b[b.rindex(b"\x93NUMPY"):], "", DIM, 10, 10)):
        with pytest.raises(ApiError) as refused:
            parse(body)
        assert refused.value.status == 422


@pytest.mark.parametrize("shape", ["(4, 2**62)", "(2**62, 4)", "(2**32, 2**32)", "(2**63-1,)"])
def test_npy_shapes_whose_product_overflows_int64_are_422(shape: str) -> None:
    """(4, 2**62): numpy's product wraps to 0, so an empty body passed the length check and reshape
    raised, a 500 on /v1/search. Sizes are multiplied as Python integers, after the dim is checked."""
    body = _raw_npy(_HEADER.format("<f4", shape.replace("2**62", str(2**62)).replace(
        "2**32", str(2**32)).replace("2**63-1", str(2**63 - 1))), b"")
    for parse in (lambda b: parse_npy_request(b, "", 4, 10, 10),
                  lambda b: parse_upsert_npy(npy(np.array([1])) + b, DIM, "l2", 10)):
        with pytest.raises(ApiError) as refused:
            parse(body)
        assert refused.value.status == 422


def test_metadata_is_bounded_in_bytes_a_point_and_a_string() -> None:
    """8 MB string values were accepted (20 of them grew a served index's processes by 583 MB):
    a string value and a point's metadata have a bound in bytes, refused as a 422 on metadata."""
    for value, says in (("x" * 8_000_000, "string of more than"),
                        ("é" * (MAX_STRING_BYTES // 2 + 1), "string of more than")):  # bytes, not characters
        with pytest.raises(ApiError) as refused:
            upsert({"ids": [1], "vectors": [V], "metadata": [{"lang": value}]})
        assert refused.value.field == "metadata" and says in refused.value.message
    kinds = {f"s{n}": "string" for n in range(4)}
    near = MAX_STRING_BYTES - 10
    ok = parse_upsert(orjson.dumps({"ids": [1], "vectors": [V], "metadata": [{"s0": "a" * near}]}),
                      DIM, "l2", kinds, 10)
    assert ok[0].metadata == {"s0": "a" * near}
    with pytest.raises(ApiError) as refused:  # each string under its bound, the point over its own
        parse_upsert(orjson.dumps({"ids": [1], "vectors": [V], "metadata": [
            {name: "a" * near for name in kinds}]}), DIM, "l2", kinds, 10)
    assert refused.value.field == "metadata"
    assert f"more than {MAX_METADATA_BYTES} a point" in refused.value.message


def test_a_float32_column_refuses_what_float32_cannot_hold() -> None:
    """1e39 in a float32 column was stored as inf; a float64 column takes it."""
    with pytest.raises(ApiError) as refused:
        parse_upsert(orjson.dumps({"ids": [1], "vectors": [V], "metadata": [{"f": 1e39}]}), DIM, "l2",
                     {"f": "float32"}, 10)
    assert refused.value.field == "metadata" and "float32" in refused.value.message
    with pytest.raises(ApiError) as refused:  # a float16 column: 70000 was stored as inf too
        parse_upsert(orjson.dumps({"ids": [1], "vectors": [V], "metadata": [{"h": 70000.0}]}), DIM, "l2",
                     {"h": "float16"}, 10)
    assert refused.value.field == "metadata" and "float16" in refused.value.message
    for kind, value in (("float32", -3.0e38), ("number", 1e39), ("float16", 65504.0)):
        ops = parse_upsert(orjson.dumps({"ids": [1], "vectors": [V], "metadata": [{"f": value}]}), DIM,
                           "l2", {"f": kind}, 10)
        assert ops[0].metadata == {"f": value}
    assert check_filter({"f": {"$gt": 0.5}}, {"f": "float32"}) is not None


def test_a_header_length_of_a_backslash_byte_is_read_and_a_backslash_in_its_text_is_not() -> None:
    """A valid header of 92 bytes (0x5C, a backslash, as its length's low byte; other writers need
    not pad as NumPy does) parses; a backslash inside the header's text is a 422 before NumPy's
    literal_eval compiles it (an invalid escape warned there)."""
    ids = np.array([5, 6], np.int64).tobytes()
    text = _HEADER.format("<i8", "(2,)")
    text += " " * (91 - len(text)) + "\n"
    assert len(text) == 92
    body = b"\x93NUMPY\x01\x00" + (92).to_bytes(2, "little") + text.encode("latin1") + ids
    assert parse_delete_npy(body, 10) == [Delete(5), Delete(6)]
    escaped = _raw_npy("{'descr': '<i8', 'fortran_order': False, 'shape': (2,), '\\p': 1}", ids)
    with pytest.raises(ApiError) as refused:
        parse_delete_npy(escaped, 10)
    assert refused.value.status == 422 and "backslash" in refused.value.message


def test_an_npy_delete_holds_the_ids_alone() -> None:
    with pytest.raises(ApiError) as refused:
        parse_delete_npy(npy(np.array([1]), np.array([V])), 10)
    assert refused.value.field == "body" and "ids alone" in refused.value.message


def test_a_delete_by_filter_is_a_checked_search_filter_or_nothing() -> None:
    assert delete_filter(b'{"ids": [1, 2]}', KINDS, 1000) is None  # by ids: parse_delete's
    assert delete_filter(b'{"filter": {"label": 3}}', KINDS, 1000) == check_filter({"label": 3}, KINDS, 1000)
    big = 2**53 + 1  # compared exactly, as a search's filter is
    assert str(big) in delete_filter(orjson.dumps({"filter": {"big": big}}), KINDS, 1000)  # type: ignore[operator]
    for body, field, says in [
        (b'{"ids": [1], "filter": {"label": 3}}', "filter", "not both"),
        (b'{"filter": {"nope": 3}}', "filter", "nope"),
        (b'{"filter": {"label": 300}}', "filter", "300"),
        (b'{"filter": {"label": 3}, "vectors": []}', "vectors", "unknown field"),
    ]:
        with pytest.raises(ApiError) as refused:
            delete_filter(body, KINDS, 1000)
        assert (refused.value.status, refused.value.field) == (422, field) and says in refused.value.message
    with pytest.raises(ApiError) as refused:
        delete_filter(b'{"filter": {"label": 3}}', {}, 1000)
    assert "without metadata" in refused.value.message


def _front(tmp_path: Path) -> tuple[WriteFront, Manifest]:
    (tmp_path / "idx").mkdir()
    dataset = DatasetInfo.model_construct(metadata_kinds=KINDS)  # what a write's parse reads of it
    manifest = Manifest.model_construct(log_position=0, dim=DIM, metric="l2", dataset=dataset,
                                        index_factory="IVF8,Flat")
    return WriteFront(tmp_path / "idx" / "log.sqlite"), manifest


def _upsert(front: WriteFront, manifest: Manifest, id_: int, label: int | None) -> int:
    body = {"ids": [id_], "vectors": [V], "metadata": [None if label is None else {"label": label}]}
    return asyncio.run(front.accept(orjson.dumps(body), True, manifest))["position"]


def test_matches_are_carried_forward_through_the_writes_logged_since() -> None:
    """Each shard's matches, from its own position: a delete drops an id, an upsert keeps or adds
    its id by its new metadata (none: null columns), whichever shard found what."""
    where = check_filter({"label": 3}, KINDS, 100)
    schema = metadata_schema(KINDS)
    logged = [(5, [Upsert(9, np.ones(DIM, np.float32), {"label": 4})]),  # stops matching
              (6, [Upsert(20, np.ones(DIM, np.float32), {"label": 3}), Delete(12)]),  # a new match
              (7, [Upsert(4, np.ones(DIM, np.float32), None)])]  # no metadata: no match
    found = [(np.array([4, 9], np.int64), 4), (np.array([12, 30], np.int64), 5)]
    assert Carried(found, where, schema).through(logged).ids().tolist() == [20, 30]
    assert Carried(found, where, schema).through([]).ids().tolist() == [4, 9, 12, 30]
    # a few requests at a time, as the router reads them, carries to the same ids and position
    carried = Carried(found, where, schema)
    for at in range(len(logged)):
        assert carried.position == (4 if at == 0 else logged[at - 1][0])
        carried.through(logged[at:at + 1])
    assert carried.ids().tolist() == [20, 30] and carried.position == 7


def test_carried_matches_equal_the_true_state_over_random_logs() -> None:
    """A model: random requests (upserts that move ids between shards, with or without metadata;
    deletes) on a random base, each shard looking at a random position and finding the live ids
    it holds that match there; carried from the earliest of them, a random number of requests at a
    time, the ids are exactly those matching in the log's newest request."""
    rng = np.random.default_rng(43)
    where = check_filter({"label": 3}, KINDS, 100)
    schema, vector = metadata_schema(KINDS), np.ones(DIM, np.float32)
    for _ in range(400):
        shards, ids = int(rng.integers(1, 5)), rng.permutation(30).tolist()
        state = {i: (int(rng.integers(shards)), int(rng.integers(2, 5))) for i in ids[:int(rng.integers(31))]}
        logged: list[tuple[int, list]] = []
        states = [dict(state)]  # after each request
        for position in range(1, int(rng.integers(1, 15))):
            ops: list = []
            for id_ in rng.choice(30, int(rng.integers(1, 4)), replace=False).tolist():
                if rng.random() < 0.3:
                    ops.append(Delete(id_))
                    state.pop(id_, None)
                else:
                    label = None if rng.random() < 0.2 else int(rng.integers(2, 5))
                    ops.append(Upsert(id_, vector, None if label is None else {"label": label}))
                    state[id_] = (int(rng.integers(shards)), label)
            logged.append((position, ops))
            states.append(dict(state))
        at = rng.integers(len(logged) + 1, size=shards).tolist()
        found = [(np.array([i for i, (home, label) in states[a].items() if home == s and label == 3],
                           np.int64), a) for s, a in enumerate(at)]
        carried = Carried(found, where, schema)
        while carried.position < len(logged):  # read as the router reads: past the position carried to
            carried.through(logged[carried.position:carried.position + int(rng.integers(1, 4))])
        assert carried.ids().tolist() == sorted(i for i, (_, label) in state.items() if label == 3)
        assert carried.position == len(logged)


def test_an_id_found_on_two_shards_counts_once_against_the_limit() -> None:
    """An id that moved between shards while they looked is in both answers: with every shard's
    ids sent, the count is of distinct ids, so a filter within the limit is not refused; a shard
    alone over the limit sent its count only, and the whole is refused without ids."""
    schema = pa.schema([("label", pa.int64())])
    moved = [(np.array([1, 2, 3], np.int64), 3, 7, schema), (np.array([3, 4], np.int64), 2, 8, None)]
    found, count, held = gathered(moved, 4)
    assert count == 4 and held == schema and [ids.tolist() for ids, _ in found] == [[1, 2, 3], [3, 4]]
    assert [at for _, at in found] == [7, 8]
    assert gathered(moved, 3)[:2] == ([], 4)
    over = [(np.zeros(0, np.int64), 5, 7, None), (np.array([3], np.int64), 1, 8, None)]
    assert gathered(over, 4) == ([], 6, None)


def test_upserts_are_judged_in_the_shards_own_column_types() -> None:
    """A float32 column holds 0.1 as 0.100000001: the shards' delta does not match it to 0.1, and
    neither may the carry-forward, which evaluates with the schema the shards send."""
    kinds = {"score": "number"}
    point = [(1, [Upsert(3, np.ones(DIM, np.float32), {"score": 0.1})])]
    for op, float32, float64 in (({"score": 0.1}, [], [3]), ({"score": {"$gt": 0.1}}, [3], [])):
        where = check_filter(op, kinds, 100)
        none = [(np.zeros(0, np.int64), 0)]
        held = pa.schema([("score", pa.float32())])
        assert Carried(none, where, held).through(point).ids().tolist() == float32
        assert Carried(none, where, metadata_schema(kinds)).through(point).ids().tolist() == float64


def _on(find: Callable[[], Awaitable[tuple]], manifest: Manifest, log: object, where: str) -> Callable:
    """`find` as the router evaluates a delete by filter: on one served version, every time."""
    async def evaluate() -> tuple:
        return await find(), manifest, log, where
    return evaluate


def test_a_delete_by_filter_deletes_what_matches_when_it_is_appended(tmp_path: Path) -> None:
    """The shards found their matches at two positions, and writes landed after both and while they
    looked: the delete, appended after all of them, deletes what matches then, in one try."""
    front, manifest = _front(tmp_path)
    log = front.path
    where = check_filter({"label": 3}, KINDS, 100)
    assert _upsert(front, manifest, 9, 3) == 1  # the shards saw 9 match, at 1
    evaluations: list[int] = []

    async def find() -> tuple:
        evaluations.append(len(evaluations))
        await front.accept(orjson.dumps({"ids": [9], "vectors": [V], "metadata": [{"label": 5}]}), True,
                           manifest, log)  # 9 stops matching: position 2, after one shard looked
        await front.accept(orjson.dumps({"ids": [21], "vectors": [V], "metadata": [{"label": 3}]}), True,
                           manifest, log)  # 21 starts matching: position 3, after both looked
        return [(np.array([4, 9], np.int64), 1), (np.array([12], np.int64), 2)], 3, None

    answer = asyncio.run(delete_matching(front, _on(find, manifest, log, where)))
    assert answer == {"position": 4, "deleted": 3} and evaluations == [0]
    written = open_log(log).read(3)  # type: ignore[arg-type]
    assert written == [(4, [Delete(4), Delete(12), Delete(21)])]
    front.close()


def test_a_delete_by_filter_carries_through_more_requests_than_one_read(tmp_path: Path) -> None:
    """More requests landed while the shards looked than the router reads at once (it reads them a
    few at a time, without vectors): every one is carried, the last one's match included, and the
    log's vectors are left where they are."""
    front, manifest = _front(tmp_path)
    log = front.path
    where = check_filter({"label": 3}, KINDS, 100)
    landed = 2 * READ_REQUESTS + 5

    async def find() -> tuple:
        for id_ in range(100, 100 + landed):  # each matches, then the one before it stops matching
            await front.accept(orjson.dumps({"ids": [id_, id_ - 1], "vectors": [V, V],
                                             "metadata": [{"label": 3}, {"label": 8}]}), True, manifest, log)
        return [(np.array([7, 99], np.int64), 0)], 2, None

    answer = asyncio.run(delete_matching(front, _on(find, manifest, log, where)))
    assert answer == {"position": landed + 1, "deleted": 2}
    written = open_log(log)  # type: ignore[arg-type]
    assert written.read(landed) == [(landed + 1, [Delete(7), Delete(100 + landed - 1)])]
    ops = written.read(0, 1, vectors=False)[0][1]
    assert [op.id for op in ops] == [100, 99] and all(len(op.vector) == 0 for op in ops)  # type: ignore[union-attr]
    assert all(len(op.vector) == DIM for op in written.read(0, 1)[0][1])  # type: ignore[union-attr]
    front.close()


def test_a_delete_by_filter_past_a_truncated_log_is_a_503_saying_so(tmp_path: Path) -> None:
    """Everything after the shards' position was folded away by a compaction (nothing left to
    read): a 503 that says the log was truncated, at once, not twenty conditional appends that
    miss; nothing written."""
    front, manifest = _front(tmp_path)
    log = front.path
    where = check_filter({"label": 3}, KINDS, 100)
    for id_ in range(5):
        _upsert(front, manifest, id_, 3)
    WriteLog(log).truncate_below(6)  # type: ignore[arg-type]
    tries: list[int] = []

    async def find() -> tuple:
        tries.append(1)
        return [(np.array([1], np.int64), 2)], 1, None

    with pytest.raises(ApiError) as refused:
        asyncio.run(delete_matching(front, _on(find, manifest, log, where)))
    assert refused.value.status == 503 and "truncated" in refused.value.message and tries == [1]
    assert open_log(log).last_position() == 5  # type: ignore[arg-type]
    front.close()


def test_a_delete_by_filter_after_a_swap_reads_and_writes_the_served_log(tmp_path: Path) -> None:
    """The front last wrote to one index's log; the server now serves another index, whose shards
    found the matches: they are carried forward through that log and deleted there."""
    front, manifest = _front(tmp_path)
    where = check_filter({"label": 3}, KINDS, 100)
    assert _upsert(front, manifest, 1, 3) == 1  # the first index's log, at 1
    (tmp_path / "other").mkdir()
    other = WriteFront(tmp_path / "other" / "log.sqlite")
    for id_, label in ((5, 3), (6, 3), (5, 4)):  # 5 matched at 1, then stopped; 6 matched since
        _upsert(other, manifest, id_, label)

    async def find() -> tuple:
        return [(np.array([5], np.int64), 1)], 1, None

    answer = asyncio.run(delete_matching(front, _on(find, manifest, other.path, where)))
    assert answer == {"position": 4, "deleted": 1}
    assert open_log(other.path).read(3) == [(4, [Delete(6)])]  # type: ignore[arg-type]
    assert open_log(tmp_path / "idx" / "log.sqlite").last_position() == 1  # the first: untouched
    front.close()
    other.close()


def test_a_delete_by_filter_across_a_swap_is_evaluated_again_on_the_index_served(tmp_path: Path) -> None:
    """A swap to another index landed between the evaluation and the append: the delete is not
    appended to the old index's log, nor refused; it is evaluated again, on the index now served
    (its shards, its log), and deleted there, in the same request."""
    front, manifest = _front(tmp_path)
    where = check_filter({"label": 3}, KINDS, 100)
    assert _upsert(front, manifest, 1, 3) == 1  # the first index's log, at 1
    (tmp_path / "other").mkdir()
    other = WriteFront(tmp_path / "other" / "log.sqlite")
    assert _upsert(other, manifest, 8, 3) == 1
    old, new = front.path, other.path
    evaluated: list[object] = []

    async def evaluate() -> tuple:  # the first time on the old index; the swap lands after it
        log = old if not evaluated else new
        evaluated.append(log)
        return ([(np.array([1 if log == old else 8], np.int64), 1)], 1, None), manifest, log, where

    answer = asyncio.run(delete_matching(front, evaluate, served=lambda: (manifest, new)))
    assert evaluated == [old, new] and answer == {"position": 2, "deleted": 1}
    assert open_log(new).read(1) == [(2, [Delete(8)])]  # type: ignore[arg-type]
    assert open_log(old).last_position() == 1  # type: ignore[arg-type]  # untouched
    front.close()
    other.close()


@pytest.mark.parametrize("swap", ["while asked", "while carried"])
def test_a_swap_while_the_shards_are_asked_or_the_matches_carried_is_evaluated_again(tmp_path: Path,
                                                                                     swap: str) -> None:
    """The old index's shards went with a swap while they were asked (the router's evaluation says
    LogMoved), or the swap landed after the writes thread read what is served, while the matches
    were carried: either way the delete is evaluated again on the index now served and lands in
    its log, never in the old one's."""
    front, manifest = _front(tmp_path)
    where = check_filter({"label": 3}, KINDS, 100)
    assert _upsert(front, manifest, 1, 3) == 1
    (tmp_path / "other").mkdir()
    other = WriteFront(tmp_path / "other" / "log.sqlite")  # the index swapped to: its own log
    assert _upsert(other, manifest, 8, 3) == 1
    other.close()
    old, new = front.path, other.path
    serving, evaluated = [old], []

    async def evaluate() -> tuple:
        log = serving[0]
        evaluated.append(log)
        if swap == "while asked" and log == old:
            serving[0] = new
            raise LogMoved("the old version's shards went with the swap")
        return ([(np.array([1 if log == old else 8], np.int64), 1)], 1, None), manifest, log, where

    def served() -> tuple:  # read in the writes thread, before the carry, then before the append
        now = serving[0]
        if swap == "while carried":
            serving[0] = new  # the swap lands right after this read
        return manifest, now

    answer = asyncio.run(delete_matching(front, evaluate, served=served))
    assert evaluated == [old, new] and answer == {"position": 2, "deleted": 1}
    assert open_log(new).read(1) == [(2, [Delete(8)])]  # type: ignore[arg-type]
    assert open_log(old).last_position() == 1  # type: ignore[arg-type]  # untouched
    front.close()


def test_a_delete_by_filter_is_bounded_and_gives_up_with_a_503(tmp_path: Path) -> None:
    front, manifest = _front(tmp_path)
    where = check_filter({"label": 3}, KINDS, 100)

    async def over() -> tuple:
        return [], 11, None  # a shard over the limit sends the count alone

    served = (manifest, tmp_path / "other.sqlite")  # a swap moved the server meanwhile, every time

    async def found() -> tuple:
        return [(np.array([1], np.int64), 0)], 1, None

    for find, status, says, now in ((over, 422, "11 points", None), (found, 503, "kept changing", served)):
        with pytest.raises(ApiError) as refused:
            asyncio.run(delete_matching(front, _on(find, manifest, front.path, where), limit=10,
                                        served=None if now is None else (lambda now=now: now)))
        assert refused.value.status == status and says in refused.value.message
    assert not front.deleting and not (tmp_path / "idx" / "log.sqlite").exists()  # nothing written
    assert _upsert(front, manifest, 5, 3) == 1

    async def grown() -> tuple:  # 10 found, and an upsert since makes 11: over the limit
        await front.accept(orjson.dumps({"ids": [6], "vectors": [V], "metadata": [{"label": 3}]}), True,
                           manifest)
        return [(np.arange(10, 20), 1)], 10, None
    with pytest.raises(ApiError) as grew:
        asyncio.run(delete_matching(front, _on(grown, manifest, front.path, where), limit=10))
    assert grew.value.status == 422 and "11 points" in grew.value.message
    assert open_log(front.path).last_position() == 2  # type: ignore[arg-type]

    async def nothing() -> tuple:
        return [(np.zeros(0, np.int64), 2)], 0, None
    answer = asyncio.run(delete_matching(front, _on(nothing, manifest, front.path, where)))
    assert answer == {"position": None, "deleted": 0}
    front.deleting = True  # one at a time per router
    with pytest.raises(ApiError) as busy:
        asyncio.run(delete_matching(front, _on(nothing, manifest, front.path, where)))
    assert busy.value.status == 503 and busy.value.retry_after
    front.close()
    no_log = WriteFront(None)
    with pytest.raises(ApiError) as refused:
        asyncio.run(delete_matching(no_log, _on(nothing, manifest, None, where)))
    assert refused.value.status == 501
    no_log.close()


def _queued_behind(front: WriteFront, bodies: list[bytes], manifest: Manifest, cancel: tuple[int, ...] = (),
                   **kwargs) -> list:
    """`bodies` accepted at once while the writes thread is busy, so that they wait behind each
    other: what each got (its answer, or the exception raised), in the order they were sent; those
    at `cancel` cancelled while they wait."""
    busy = threading.Event()
    front._thread.submit(busy.wait)  # the writes thread is taken until every request is queued

    async def send() -> list:
        try:
            sent = [asyncio.ensure_future(front.accept(body, True, manifest, **kwargs)) for body in bodies]
            await asyncio.sleep(0.05)  # each parsed and queued (accept's first await)
            for at in cancel:  # their clients gone before their turn
                sent[at].cancel()
            await asyncio.sleep(0)
        finally:
            busy.set()
        return await asyncio.gather(*sent, return_exceptions=True)

    return asyncio.run(send())


def _group_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The requests in each group commit from now on (the real WriteLog.append_many, counted)."""
    groups: list[int] = []
    original = WriteLog.append_many

    def counted(log: WriteLog, requests: list, *args, **kwargs) -> list[int]:
        groups.append(len(requests))
        return original(log, requests, *args, **kwargs)

    monkeypatch.setattr(WriteLog, "append_many", counted)
    return groups


def _body(id_: int) -> bytes:
    return orjson.dumps({"ids": [id_], "vectors": [V], "metadata": [{"label": id_ % 7}]})


def test_writes_waiting_behind_each_other_are_committed_together_in_the_order_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group commit: the requests queued while the writes thread was busy go to the log in one
    transaction (one fsync), each its own request at consecutive positions, in the order sent."""
    front, manifest = _front(tmp_path)
    _upsert(front, manifest, 1, 1)  # the log open; its first position taken
    groups = _group_sizes(monkeypatch)
    answers = _queued_behind(front, [_body(id_) for id_ in range(10, 18)], manifest)
    assert [a["position"] for a in answers] == list(range(2, 10)) and groups == [8]
    logged = open_log(front.path).read(1)
    assert [(p, [op.id for op in ops]) for p, ops in logged] == [(p, [p + 8]) for p in range(2, 10)]


def test_requests_that_wait_behind_each_other_hand_off_to_the_writes_thread_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One drain per group, not one per request: a request queued while a drain is due is taken by
    it (each hand-off wakes the writes thread and takes the GIL from the router's loop)."""
    front, manifest = _front(tmp_path)
    drains: list[int] = []
    original = WriteFront._drain

    def counted(self: WriteFront) -> None:
        drains.append(len(self._queued))
        original(self)

    monkeypatch.setattr(WriteFront, "_drain", counted)
    commits: list[int] = []
    front.on_commit = commits.append  # the router's shardserve_write_group_requests
    answers = _queued_behind(front, [_body(id_) for id_ in range(10, 18)], manifest)
    front._thread.submit(lambda: None).result()  # the drain told on_commit after answering: it is done
    assert [a["position"] for a in answers] == list(range(1, 9)) and drains == [8] and commits == [8]
    answers = _queued_behind(front, [_body(20)], manifest)  # queued after that drain read the queue
    front._thread.submit(lambda: None).result()
    assert answers[0]["position"] == 9 and drains == [8, 1] and commits == [8, 1] and not front._drain_due


def test_requests_arriving_during_a_group_s_commit_are_the_next_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a drain waits for its commit (the fsync), the requests that arrive queue for the next
    drain, which they submit: none is left waiting with no drain coming."""
    front, manifest = _front(tmp_path)
    committing, release = threading.Event(), threading.Event()
    groups: list[int] = []
    original = WriteLog.append_many

    def slow(log: WriteLog, requests: list, *args, **kwargs) -> list[int]:
        groups.append(len(requests))
        committing.set()
        release.wait(10)
        return original(log, requests, *args, **kwargs)

    monkeypatch.setattr(WriteLog, "append_many", slow)

    async def send() -> list:
        first = asyncio.ensure_future(front.accept(_body(10), True, manifest))
        await asyncio.get_running_loop().run_in_executor(None, committing.wait, 10)  # its commit runs
        later = [asyncio.ensure_future(front.accept(_body(id_), True, manifest)) for id_ in (11, 12, 13)]
        await asyncio.sleep(0.05)  # each parsed and queued
        release.set()
        return await asyncio.gather(first, *later)

    answers = asyncio.run(send())
    assert [a["position"] for a in answers] == [1, 2, 3, 4] and groups == [1, 3] and not front._drain_due


def test_a_request_whose_hand_off_failed_is_refused_and_the_next_goes_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    front, manifest = _front(tmp_path)
    submit = front._thread.submit

    def fails_once(*args, **kwargs):
        monkeypatch.setattr(front._thread, "submit", submit)
        raise MemoryError

    monkeypatch.setattr(front._thread, "submit", fails_once)
    with pytest.raises(MemoryError):
        asyncio.run(front.accept(_body(10), True, manifest))
    assert not front._queued and not front._drain_due
    assert _upsert(front, manifest, 11, 1) == 1  # not stranded behind a drain that never came
    assert [[op.id for op in ops] for _, ops in open_log(front.path).read(0)] == [[11]]


def test_a_failing_commit_metric_does_not_fail_a_durable_write(tmp_path: Path) -> None:
    front, manifest = _front(tmp_path)

    def broken(requests: int) -> None:
        raise ValueError("metrics down")

    front.on_commit = broken
    assert front.upsert(_body(10), manifest) == {"position": 1, "upserted": 1}  # alone
    assert _upsert(front, manifest, 11, 1) == 2  # in a group
    assert open_log(front.path).last_position() == 2


def test_a_request_of_a_group_past_the_backlog_is_refused_alone(tmp_path: Path) -> None:
    front, manifest = _front(tmp_path)
    front.max_backlog = 3
    answers = _queued_behind(front, [_body(id_) for id_ in range(10, 15)], manifest)
    assert [a["position"] for a in answers[:3]] == [1, 2, 3]
    assert all(isinstance(a, ApiError) and a.status == 503 and "backlog" in a.message for a in answers[3:])
    assert [p for p, _ in open_log(front.path).read(0)] == [1, 2, 3]  # nothing of the refused


def test_a_group_queued_across_a_swap_goes_to_the_log_then_served(tmp_path: Path) -> None:
    """Requests parsed against one index, written once their turn comes to the index served then
    (its log, past its position), each parsed again against it; one that no longer fits fails alone."""
    front, manifest = _front(tmp_path)
    (tmp_path / "new").mkdir()
    new_log = tmp_path / "new" / "log.sqlite"
    narrower = Manifest.model_construct(log_position=40, dim=DIM, metric="l2", index_factory="IVF8,Flat",
                                        dataset=DatasetInfo.model_construct(metadata_kinds={}))
    answers = _queued_behind(front, [_body(10), _body(11)], manifest, served=lambda: (narrower, new_log))
    assert all(isinstance(a, ApiError) and a.status == 422 and a.field == "metadata" for a in answers)
    plain = [orjson.dumps({"ids": [id_], "vectors": [V]}) for id_ in (12, 13)]
    answers = _queued_behind(front, plain, manifest, served=lambda: (narrower, new_log))
    assert [a["position"] for a in answers] == [41, 42]
    assert [p for p, _ in open_log(new_log).read(0)] == [41, 42]
    assert not (tmp_path / "idx" / "log.sqlite").exists()  # nothing went to the old index's log


def test_a_swap_between_a_group_s_reading_and_its_append_sends_it_to_the_new_log(tmp_path: Path) -> None:
    """`served` read for each request says the old index; read again just before the append, the
    new one: the group goes there, parsed again against it, and nothing to the old log."""
    front, manifest = _front(tmp_path)
    (tmp_path / "new").mkdir()
    new_log = tmp_path / "new" / "log.sqlite"
    newer = Manifest.model_construct(log_position=40, dim=DIM, metric="l2", index_factory="IVF8,Flat",
                                     dataset=DatasetInfo.model_construct(metadata_kinds=KINDS))
    reads = iter(range(100))

    def served() -> tuple:
        return (manifest, front.path) if next(reads) < 2 else (newer, new_log)  # the swap, after two

    answers = _queued_behind(front, [_body(10), _body(11)], manifest, served=served)
    assert [a["position"] for a in answers] == [41, 42]
    assert [[op.id for op in ops] for _, ops in open_log(new_log).read(0)] == [[10], [11]]
    assert not (tmp_path / "idx" / "log.sqlite").exists()


def test_a_write_whose_client_went_away_before_its_turn_is_not_written(tmp_path: Path) -> None:
    front, manifest = _front(tmp_path)
    answers = _queued_behind(front, [_body(id_) for id_ in (10, 11, 12)], manifest, cancel=(1,))
    assert [a["position"] for a in (answers[0], answers[2])] == [1, 2]
    assert isinstance(answers[1], asyncio.CancelledError)
    assert [[op.id for op in ops] for _, ops in open_log(front.path).read(0)] == [[10], [12]]
    assert front.waiting == 0


def test_a_group_commit_holds_at_most_group_points_operations(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from shardserve.writes import accept

    front, manifest = _front(tmp_path)
    groups = _group_sizes(monkeypatch)
    monkeypatch.setattr(accept, "GROUP_POINTS", 2)
    answers = _queued_behind(front, [_body(id_) for id_ in range(10, 15)], manifest)
    assert [a["position"] for a in answers] == [1, 2, 3, 4, 5] and groups == [2, 2, 1]


def test_a_write_to_a_closed_front_is_refused_and_not_written(tmp_path: Path) -> None:
    front, manifest = _front(tmp_path)
    _upsert(front, manifest, 1, 1)
    front.close()
    with pytest.raises(RuntimeError):
        asyncio.run(front.accept(_body(2), True, manifest))
    assert not front._queued and front.waiting == 0 and not front._drain_due
    assert open_log(front.path).last_position() == 1


def test_the_limits_get_v1_index_shows_are_the_ones_enforced() -> None:
    from shardserve.query.api import Limits
    from shardserve.writes.accept import MAX_BACKLOG_BYTES

    limits = Limits(10, 10, 10, 10)
    assert (limits.max_metadata_bytes, limits.max_string_bytes, limits.max_write_backlog_bytes) == (
        MAX_METADATA_BYTES, MAX_STRING_BYTES, MAX_BACKLOG_BYTES)


def test_an_index_kind_compaction_cannot_fold_writes_into_is_501_before_anything_is_written(
        tmp_path: Path) -> None:
    """`IVF64,PQ16+8` (a refine step keeping its codes by id) cannot be compacted: its writes were
    accepted and held until the backlog refused every upsert with a 503. Now a 501 naming the kind,
    upserts and deletes alike, and the log holds nothing."""
    front, manifest = _front(tmp_path)
    refused = manifest.model_copy(update={"index_factory": "IVF64,PQ2+4"})
    for upsert_it, body in ((True, _body(1)), (False, b'{"ids": [1]}')):
        with pytest.raises(ApiError) as answer:
            asyncio.run(front.accept(body, upsert_it, refused))
        assert answer.value.status == 501 and "IVF64,PQ2+4" in answer.value.message
    assert not Path(front.path).exists() or open_log(front.path).last_position() == 0
    _upsert(front, manifest, 1, 1)  # the same front, an index of a kind that compacts: taken


def test_traced_writes_are_stamped_in_order_and_their_group_commit_logs_their_trace(tmp_path: Path) -> None:
    """Three writes queued behind a busy writes thread ride one group commit: the two traced ones
    are stamped parsed ≤ queued ≤ commit began ≤ committed with the group's 3 requests, and the log
    keeps each one's traceparent (the untraced one's: none)."""
    front, manifest = _front(tmp_path)
    traced = [WriteTrace(f"00-{n:032x}-{n:016x}-01") for n in (1, 2)]
    held = threading.Event()

    async def three() -> list[dict]:
        front._thread.submit(held.wait, 30)  # the writes thread busy: all three queue behind it
        bodies = [orjson.dumps({"ids": [n], "vectors": [V]}) for n in (1, 2, 3)]
        writes = [front.accept(bodies[0], True, manifest, trace=traced[0]),
                  front.accept(bodies[1], True, manifest),
                  front.accept(bodies[2], True, manifest, trace=traced[1])]
        tasks = [asyncio.ensure_future(write) for write in writes]
        await asyncio.sleep(0)  # each task runs up to its wait: parsed and queued
        held.set()
        return list(await asyncio.gather(*tasks))

    assert [answer["position"] for answer in asyncio.run(three())] == [1, 2, 3]
    for trace in traced:
        assert 0 < trace.arrived <= trace.queued <= trace.commit_started <= trace.committed
        assert trace.group == 3
    assert traced[0].commit_started == traced[1].commit_started  # one commit
    log = open_log(tmp_path / "idx" / "log.sqlite", readonly=True)
    assert [entry.trace for entry in log.entries(0)] == [traced[0].traceparent, None, traced[1].traceparent]
    log.close()
    front.close()
