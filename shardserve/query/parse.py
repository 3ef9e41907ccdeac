"""The router's request parser: JSON bodies and `.npy` bodies into a validated `ParsedQuery`.

Why not let FastAPI/pydantic parse the body: the router is plain ASGI (FastAPI's middleware stack
costs CPU on every request), and this parser also refuses what pydantic's lax floats would coerce
(strings, booleans) and what FAISS would answer with nonsense (absurd magnitudes, zero vectors under
cosine). `make bench` reports both parse costs side by side (`parse_cost`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import math
from collections.abc import AsyncIterator, Collection
from tokenize import TokenError
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

import numpy as np
import orjson
from numpy.lib import format as npy_format

from shardserve.index.assigner import FILTER_WIDEN
from shardserve.index.indexes import prepare_vectors
from shardserve.index.manifest import Manifest
from shardserve.query.api import KNOWN_PARAMS, ApiError, Limits, ParsedQuery
from shardserve.query.filters import check_filter

if TYPE_CHECKING:
    from shardserve.transport.http_front import Request


async def read_body(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The request body, refused (413) as soon as it passes `limit` bytes: a chunked upload without
    Content-Length is never buffered beyond the limit, whatever size it claims or grows to."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body", f"body exceeds {limit} bytes (stopped reading at {size})")
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def receive_body(chunks: AsyncIterator[bytes], declared: str | None, limit: int,
                       timeout_s: float) -> bytes:
    """413 past `limit` (declared in Content-Length, or counted while streaming), 408 past
    `timeout_s`: a slow or endless upload costs the server neither memory nor a query slot."""
    if declared is not None and _digits(declared) and (len(declared) > 18 or int(declared) > limit):
        raise ApiError(413, "body", f"body of {declared} bytes exceeds {limit}")
    try:  # asyncio.timeout: a timer, not a task per request as wait_for would create
        async with asyncio.timeout(timeout_s):
            return await read_body(chunks, limit)
    except TimeoutError:
        raise ApiError(408, "body", f"body not received within {timeout_s} s") from None


def parse_query(request: Request, manifest: Manifest, supported: Collection[str],
                limits: Limits, payload: dict | None = None) -> ParsedQuery:
    """A /v1/search request checked against the served index: its dim, the params its type takes,
    the work limit; vectors normalised for cosine. JSON unless the body is .npy (`is_npy`); a JSON
    body carries every field, so the query string is not read then. `payload`: the JSON body
    already decoded, its vectors possibly a float32 array (a text request, embedded)."""
    if payload is not None:
        query = parse_search_request(request.body, manifest.dim, limits.max_k, limits.max_vectors,
                                     manifest.metric, manifest.dataset.metadata_kinds,
                                     max(shard.num_vectors for shard in manifest.shards), payload)
    elif is_npy(request.content_type):
        query = parse_npy_request(request.body, request.query, manifest.dim, limits.max_k,
                                  limits.max_vectors, manifest.metric)
    else:
        query = parse_search_request(request.body, manifest.dim, limits.max_k, limits.max_vectors,
                                     manifest.metric, manifest.dataset.metadata_kinds,
                                     max(shard.num_vectors for shard in manifest.shards))
    check_work(query, limits.max_work)
    for name, _ in query.params:
        if name not in supported:
            raise ApiError(422, f"params.{name}",
                           f"param {name!r} does not apply to {manifest.index_factory} "
                           f"(supported: {sorted(supported) or 'none'})")
    missing = [c for c in query.include if c not in manifest.dataset.metadata_columns]
    if missing:
        raise ApiError(422, "include", f"no metadata column {missing[0]!r} in this index (it has: "
                                       f"{manifest.dataset.metadata_columns or 'none'})")
    if manifest.metric == "cosine":
        query = dataclasses.replace(query, matrix=prepare_vectors(query.matrix, "cosine"))
    return query


def parse_search_request(body: bytes, dim: int, max_k: int, max_vectors: int,
                         metric: str = "l2", kinds: dict[str, str] | None = None,
                         shard_rows: int = 0, payload: dict | None = None) -> ParsedQuery:
    """Parse and validate a /v1/search body; raise ApiError(422) naming the field at fault.
    `kinds`: the index's filterable metadata columns (query.filters), for a `filter`; `shard_rows`:
    the largest shard's rows, what each comparison of a filter passes over; `payload`: the body
    already decoded (its vectors may be a float32 array then)."""
    try:
        payload = orjson.loads(body) if payload is None else payload
    except orjson.JSONDecodeError as exc:
        if b"NaN" in body or b"Infinity" in body:
            field = "vectors" if b'"vectors"' in body else "vector"
            raise ApiError(422, field, f"{field} contains NaN/Infinity (not valid JSON numbers)") from None
        raise ApiError(422, "body", f"body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ApiError(422, "body", "body must be a JSON object")
    unknown = set(payload) - {"vector", "vectors", "k", "params", "require_full", "include", "filter",
                              "offset", "score_threshold"}
    if unknown:
        raise ApiError(422, sorted(unknown)[0], f"unknown field(s) {sorted(unknown)}")
    single = "vector" in payload
    if single == ("vectors" in payload):
        raise ApiError(422, "vector", "give exactly one of 'vector' or 'vectors'")
    field = "vector" if single else "vectors"
    matrix = _matrix(payload[field], field, single, dim, max_vectors, metric,
                     b"true" in body or b"false" in body)
    k = payload.get("k", 10)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= max_k:
        raise ApiError(422, "k", f"k must be an integer in [1, {max_k}], got {k!r}")
    offset = payload.get("offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= max_k - k:
        raise ApiError(422, "offset", f"offset must be an integer in [0, max_k - k] = [0, {max_k - k}], "
                                      f"got {offset!r}")
    threshold = payload.get("score_threshold")
    if threshold is not None and (not isinstance(threshold, int | float) or isinstance(threshold, bool)
                                  or not math.isfinite(threshold)):
        raise ApiError(422, "score_threshold", f"score_threshold must be a finite number, got {threshold!r}")
    require_full = payload.get("require_full", False)
    if not isinstance(require_full, bool):
        raise ApiError(422, "require_full", "require_full must be true or false")
    where = None if payload.get("filter") is None else check_filter(payload["filter"], kinds or {},
                                                                           shard_rows)
    return ParsedQuery(matrix=matrix, k=k + offset, params=_params(payload.get("params")), single=single,
                       require_full=require_full, include=_include(payload.get("include")), filter=where,
                       offset=offset, threshold=None if threshold is None else float(threshold))


NPY_CONTENT_TYPE = "application/x-npy"


_QUERY_OPTIONS = ("k", "require_full", "include")


def is_npy(content_type: str) -> bool:
    return content_type.partition(";")[0].strip().lower() == NPY_CONTENT_TYPE


def npy_body(vectors: np.ndarray) -> bytes:
    """A .npy request body of float32 query vectors, (dim,) or (n, dim): what clients send."""
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(vectors, np.float32), allow_pickle=False)
    return buffer.getvalue()


def parse_npy_request(body: bytes, query_string: str, dim: int, max_k: int, max_vectors: int,
                      metric: str = "l2") -> ParsedQuery:
    """A /v1/search body in NumPy's .npy format (`Content-Type: application/x-npy`): one float
    array, (dim,) for one query or (n, dim) for a batch; the other fields in the URL's query string
    (`?k=10&nprobe=16&include=caption&require_full=true`).

    Why a binary format: a 256 x 784 batch is 256 single bodies' worth of JSON numbers to parse,
    this is one header check and a view of the bytes. Never
    unpickled: object arrays are refused like any non-float dtype."""
    matrix, single = _npy_matrix(body, dim, max_vectors)
    options: dict[str, list[str]] = {}
    for name, value in parse_qsl(query_string, keep_blank_values=True):
        options.setdefault(name, []).append(value)
    k = _query_int(options.pop("k", ["10"]), "k", 1, max_k)
    require_full = options.pop("require_full", ["false"])[-1].lower()
    if require_full not in ("true", "false", "1", "0"):
        raise ApiError(422, "require_full", "require_full must be true or false")
    include = [c for value in options.pop("include", []) for c in value.split(",") if c]
    params = {name: _query_int(values, f"params.{name}", 1, 65536) for name, values in options.items()
              if name in KNOWN_PARAMS}
    unknown = sorted(set(options) - set(KNOWN_PARAMS))
    if unknown:
        raise ApiError(422, unknown[0], f"unknown query option(s) {unknown}: use "
                                        f"{list(_QUERY_OPTIONS + KNOWN_PARAMS)}")
    return ParsedQuery(matrix=_checked(matrix, "vector" if single else "vectors", dim, metric), k=k,
                       params=_params(params), single=single, require_full=require_full in ("true", "1"),
                       include=_include(include))


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes "²" and other digits int() refuses."""
    return text.isascii() and text.isdigit()


def _query_int(values: list[str], field: str, low: int, high: int) -> int:
    text = values[-1]
    if not _digits(text) or len(text) > 9 or not low <= int(text) <= high:
        raise ApiError(422, field, f"{field} must be an integer in [{low}, {high}], got {text!r}")
    return int(text)


_NPY_MAGIC = b"\x93NUMPY"


_NPY_HEADER_MAX = 4096


_npy_headers: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}  # header bytes -> parsed


def _npy_header(body: bytes, at: int = 0) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, offset of the data) of the .npy array starting at `at` in a
    body. NumPy's own header parser (a Python literal_eval) cost more than parsing a 784-float JSON
    body, so each distinct header is parsed by it once and kept: clients send few distinct shapes."""
    if body[at:at + 6] != _NPY_MAGIC or len(body) < at + 10:
        raise ApiError(422, "body", "body is not a .npy array (no \\x93NUMPY magic)")
    if body[at + 6] not in (1, 2):
        raise ApiError(422, "body", f".npy format version {body[at + 6]} is not read here: use 1 or 2")
    size_bytes = 2 if body[at + 6] == 1 else 4
    start = at + 8 + size_bytes + int.from_bytes(body[at + 8:at + 8 + size_bytes], "little")
    if start - at - 8 - size_bytes > _NPY_HEADER_MAX or start > len(body):
        raise ApiError(422, "body", "the .npy header is cut short or too long")
    header = body[at:start]
    parsed = _npy_headers.get(header)
    if parsed is None:
        if b"\\" in body[at + 8 + size_bytes:start]:  # the header's text (not its length bytes): a
            # dict of a dtype, a bool and ints never holds one; NumPy's literal_eval
            # would compile it as an escape (a DeprecationWarning on an invalid one) before refusing
            raise ApiError(422, "body", "body is not a .npy array: a backslash in its header")
        stream = io.BytesIO(header)
        try:
            version = npy_format.read_magic(stream)
            read = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
            parsed = read(stream, max_header_size=_NPY_HEADER_MAX)
        except (ValueError, OSError, SyntaxError, TokenError) as exc:  # a cut header: TokenError
            raise ApiError(422, "body", f"body is not a .npy array: {exc}") from None
        shape = parsed[0]
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            # NumPy's reader takes (-1,): frombuffer would then read the whole body, reshape guess
            raise ApiError(422, "body", f"the .npy shape {shape} holds a negative or non-integer size")
        if len(_npy_headers) >= 1024:  # bounded: a client cycling shapes only costs re-parsing
            _npy_headers.clear()
        _npy_headers[header] = parsed
    return (*parsed, start)


def _npy_matrix(body: bytes, dim: int, max_vectors: int, at: int = 0) -> tuple[np.ndarray, bool]:
    """(float32 n x dim matrix, single?) from the .npy array at `at` to the body's end; 422 naming
    what is wrong otherwise."""
    shape, fortran_order, dtype, start = _npy_header(body, at)
    if dtype.kind != "f" or dtype.hasobject:
        raise ApiError(422, "body", f"the array must hold floats (float16/32/64), not {dtype}")
    if len(shape) not in (1, 2) or 0 in shape:
        raise ApiError(422, "body", f"the array must be (dim,) or (n, dim) and non-empty, got {shape}")
    single = len(shape) == 1
    field = "vector" if single else "vectors"
    if not single and shape[0] > max_vectors:
        raise ApiError(422, field, f"too many vectors: {shape[0]} > max {max_vectors}")
    if shape[-1] != dim:  # before any product of the shape's sizes
        raise ApiError(422, field, f"wrong dimension: expected {dim}, got {shape[-1]}")
    count = math.prod(shape)  # Python integers: numpy's int64 product wraps ((4, 2**62) made 0)
    if len(body) - start != count * dtype.itemsize:
        raise ApiError(422, "body", f"the array's data is {len(body) - start} bytes, its header says "
                                    f"{count * dtype.itemsize}")
    flat = np.frombuffer(body, dtype, count, start)
    matrix = flat.reshape(shape[::-1]).T if fortran_order else flat.reshape(shape)
    with np.errstate(over="ignore", invalid="ignore"):  # float64 beyond float32's range: inf, refused
        matrix = np.ascontiguousarray(matrix.reshape(1, -1) if single else matrix, dtype=np.float32)
    if matrix.shape[1] != dim:
        raise ApiError(422, field, f"wrong dimension: expected {dim}, got {matrix.shape[1]}")
    return matrix, single


def _include(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
        raise ApiError(422, "include", "include must be a list of metadata column names")
    return tuple(dict.fromkeys(value))


_NUMBER_TYPES = {float, int}


def _numbers_only(rows: list, may_hold_booleans: bool) -> np.ndarray | None:
    """The rows as float32 when numpy's own type inference proves they hold JSON numbers only, in
    one C pass; None when it cannot (the caller then checks row by row, at a higher cost). Inference
    sees strings (`<U`), nulls and nested lists (`O`) and ragged rows (ValueError), but it turns
    `true` into 1.0: hence only for bodies without a `true`/`false` token anywhere."""
    if may_hold_booleans:
        return None
    try:
        inferred = np.array(rows)
    except (ValueError, TypeError):
        return None
    return inferred.astype(np.float32) if inferred.dtype.kind in "fi" and inferred.ndim == 2 else None


def _matrix(value: object, field: str, single: bool, dim: int, max_vectors: int,
            metric: str, may_hold_booleans: bool = True) -> np.ndarray:
    if isinstance(value, np.ndarray):  # computed by the server (embedded text), checked all the same
        if len(value) > max_vectors and not single:
            raise ApiError(422, field, f"too many vectors: {len(value)} > max {max_vectors}")
        return _checked(value.reshape(1, -1) if single else value, field, dim, metric)
    if not isinstance(value, list) or not value:
        raise ApiError(422, field, f"{field} must be a non-empty list")
    if not single and len(value) > max_vectors:
        raise ApiError(422, field, f"too many vectors: {len(value)} > max {max_vectors}")
    rows = [value] if single else value
    with np.errstate(over="ignore", invalid="ignore"):
        matrix = _numbers_only(rows, may_hold_booleans)
        if matrix is None:
            for row in rows:  # numpy would turn "1.5" and true into numbers: only JSON numbers are vectors
                if not isinstance(row, list) or not set(map(type, row)) <= _NUMBER_TYPES:
                    raise ApiError(422, field, f"{field} must hold numbers only (no strings, booleans "
                                               f"or nulls), all of dim {dim}")
            try:
                matrix = np.array(rows, dtype=np.float32)
            except (ValueError, TypeError):
                raise ApiError(422, field, f"{field} must hold numbers only, all of dim {dim}") from None
    return _checked(matrix, field, dim, metric)


def _checked(matrix: np.ndarray, field: str, dim: int, metric: str) -> np.ndarray:
    """The query matrix (float32, n x dim) once it is proven usable: right dim, finite, no absurd
    magnitude, no zero row under cosine. Both body formats end here."""
    with np.errstate(over="ignore", invalid="ignore"):
        # One pass of checks on the happy path: a NaN/Inf component or an out-of-range number (it
        # becomes inf) makes the row's squared norm non-finite, and so does an absurd magnitude.
        squared = (np.einsum("ij,ij->i", matrix, matrix)
                   if matrix.ndim == 2 and matrix.shape[1] == dim else None)
    if squared is None:
        got = matrix.shape[-1] if matrix.ndim == 2 else "ragged"
        raise ApiError(422, field, f"wrong dimension: expected {dim}, got {got}")
    if not np.isfinite(squared).all():
        finite_rows = np.isfinite(matrix).all(axis=1)
        if not finite_rows.all():
            row = int(np.flatnonzero(~finite_rows)[0])
            raise ApiError(422, field, f"{field} contains NaN/Inf (row {row}) or a number out of float32 "
                                       "range")
        row = int(np.flatnonzero(~np.isfinite(squared))[0])
        # distances to it would overflow float32: nonsense answers
        raise ApiError(422, field, f"{field} row {row} has an absurd magnitude (its squared norm "
                                   "overflows float32): scale your vectors")
    if metric == "cosine" and not (squared > 0).all():
        row = int(np.flatnonzero(squared <= 0)[0])
        raise ApiError(422, field, f"{field} row {row} is all zeros: it has no direction under cosine")
    return matrix


def check_work(query: ParsedQuery, max_work: int) -> None:
    """Bound what one request may ask of the shards: query vectors x probes (nprobe / efSearch),
    a filter's probes counted widened by FILTER_WIDEN, the least its plan widens them (by
    FILTER_WIDEN / share, share > EXACT_SHARE: the shards only learn the share once they scan; a
    filter matching less compares each matching row instead, bounded by the filter's own work).

    FAISS cannot be stopped once it scans, so a request past its deadline would keep the shards
    busy for everyone after it: refuse it up front instead.
    """
    probes = max((number for _, number in query.params), default=1)
    widened = math.ceil(FILTER_WIDEN * probes) if query.filter is not None else probes
    work = len(query.matrix) * widened
    if work > max_work:
        how = f"{probes} probes" + (f" widened to {widened} by the filter" if widened > probes else "")
        raise ApiError(422, "params", f"request too expensive: {len(query.matrix)} vectors x {how} "
                                      f"= {work} > max_work {max_work}; send fewer vectors "
                                      "per request or a smaller nprobe/efSearch")


def _params(value: object) -> tuple[tuple[str, int], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(422, "params", "params must be an object")
    items = []
    for name, number in sorted(value.items()):
        if name not in KNOWN_PARAMS:
            raise ApiError(422, f"params.{name}", f"unknown param {name!r}: use one of {list(KNOWN_PARAMS)}")
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= 65536:
            raise ApiError(422, f"params.{name}", f"{name} must be an integer in [1, 65536]")
        items.append((name, number))
    return tuple(items)
