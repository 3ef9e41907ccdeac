"""What the router sends a shard and gets back, as raw bytes: one encoding per batch, not per shard.

Why bytes and not numpy objects through Serve's serializer: a query batch is encoded once and the
same buffer goes to every shard; the shard maps it with `np.frombuffer` (no copy, no pickle of array
objects), and its answer comes back the same way. The hop then costs a memcpy, not a serializer.

Layout (little-endian): a fixed header, the float32 (n, dim) matrix, then — when the router already
ran the IVF coarse quantizer — the int64 (n, nprobe) list numbers and float32 (n, nprobe) coarse
distances, then the search params as JSON.

A shard decodes a batch only against its own `QueryBounds`: every header field, every list number
and every param is checked before any array reaches FAISS, which trusts the shapes it is given (a
`dim` smaller than the index's made it read past the buffer).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import orjson

from shardserve.errors import WireError
from shardserve.tracing import parse_traceparent

_QUERY = struct.Struct("<4sIIIII")  # magic, n, dim, k, nprobe of the assignment (0 = none), params len
# magic, n, k, search milliseconds, rows a filter matched, the write-log position answered at
_ANSWER = struct.Struct("<4sIIdqq")
_QUERY_MAGIC, _ANSWER_MAGIC = b"SSQ1", b"SSA3"
_ANSWER_V2, _ANSWER_V2_MAGIC = struct.Struct("<4sIIdq"), b"SSA2"  # without the position
MAX_FILTER_BYTES = 256 * 1024  # a filter's JSON: 8 levels, $in lists of 4,096 values
MAX_PARAMS_BYTES = MAX_FILTER_BYTES + 1024
MAX_EF_SEARCH = 65536


@dataclass(frozen=True, kw_only=True)
class QueryBounds:
    """What one shard accepts. Arguments:
    dim: the index's dimension; a batch must have exactly this many columns.
    nlist: IVF lists of the index (0: not an IVF index, list assignments refused).
    max_rows: query rows per batch.
    max_k: neighbours per query.
    params: search params the index takes (`nprobe` <= nlist, `efSearch` <= MAX_EF_SEARCH).
    """

    dim: int
    nlist: int
    max_rows: int
    max_k: int
    params: frozenset[str]


@dataclass
class ShardQuery:
    """One batch as every shard sees it. `assign`/`coarse`: the IVF lists each query probes and
    their coarse distances, computed once by the router (None: the shard runs its own quantizer)."""

    matrix: np.ndarray
    k: int
    params: dict
    assign: np.ndarray | None = None
    coarse: np.ndarray | None = None
    trace: str = ""  # the W3C `traceparent` of the router's fan-out span, when the batch is traced
    _encoded: bytes | None = field(default=None, repr=False, compare=False)

    def encode(self) -> bytes:
        """The wire bytes, built once however many shards the batch goes to."""
        if self._encoded is None:
            n, dim = self.matrix.shape
            nprobe = 0 if self.assign is None else self.assign.shape[1]
            sent = {**self.params, "traceparent": self.trace} if self.trace else self.params
            params = orjson.dumps(sent) if sent else b""
            parts = [_QUERY.pack(_QUERY_MAGIC, n, dim, self.k, nprobe, len(params)),
                     np.ascontiguousarray(self.matrix, np.float32).tobytes()]
            if nprobe:
                parts.append(np.ascontiguousarray(self.assign, np.int64).tobytes())
                parts.append(np.ascontiguousarray(self.coarse, np.float32).tobytes())
            parts.append(params)
            self._encoded = b"".join(parts)
        return self._encoded

    @staticmethod
    def rows(blob: bytes) -> int:
        """Query rows of an encoded batch, read from its header alone (0 for a short blob)."""
        return _QUERY.unpack_from(blob)[1] if len(blob) >= _QUERY.size else 0

    @classmethod
    def decode(cls, blob: bytes, bounds: QueryBounds) -> ShardQuery:
        """The batch, every field checked against `bounds` (WireError, a ValueError, naming the field)."""
        if len(blob) < _QUERY.size:
            raise WireError(f"shard query of {len(blob)} bytes is shorter than its header")
        magic, n, dim, k, nprobe, params_len = _QUERY.unpack_from(blob)
        if magic != _QUERY_MAGIC:
            raise WireError(f"not a shard query (magic {magic!r})")
        if dim != bounds.dim:
            raise WireError(f"dim {dim}, the index has {bounds.dim}")
        if not 1 <= n <= bounds.max_rows:
            raise WireError(f"rows {n} not in 1..{bounds.max_rows}")
        if not 1 <= k <= bounds.max_k:
            raise WireError(f"k {k} not in 1..{bounds.max_k}")
        if nprobe and not nprobe <= bounds.nlist:
            raise WireError(f"nprobe {nprobe} of the assignment, the index has {bounds.nlist} lists")
        if params_len > MAX_PARAMS_BYTES:
            raise WireError(f"params of {params_len} bytes")
        expected = _QUERY.size + 4 * n * dim + 12 * n * nprobe + params_len
        if len(blob) != expected:
            raise WireError(f"shard query of {len(blob)} bytes, its header says {expected}")
        offset = _QUERY.size
        matrix = np.frombuffer(blob, np.float32, n * dim, offset).reshape(n, dim)
        offset += 4 * n * dim
        assign = coarse = None
        if nprobe:
            assign = np.frombuffer(blob, np.int64, n * nprobe, offset).reshape(n, nprobe)
            offset += 8 * n * nprobe
            if assign.min() < -1 or assign.max() >= bounds.nlist:  # -1: no list (FAISS skips it)
                raise WireError(f"list numbers outside 0..{bounds.nlist - 1}")
            coarse = np.frombuffer(blob, np.float32, n * nprobe, offset).reshape(n, nprobe)
            offset += 4 * n * nprobe
        params = _checked_params(blob[offset:offset + params_len], bounds) if params_len else {}
        return cls(matrix, k, params, assign, coarse, params.pop("traceparent", ""))


def _checked_params(raw: bytes, bounds: QueryBounds) -> dict:
    try:
        params = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise WireError("params are not JSON") from None
    if not isinstance(params, dict) or not set(params) <= bounds.params | {"filter", "traceparent"}:
        raise WireError(f"params must be an object of {sorted(bounds.params)}, a filter and a traceparent")
    where = params.pop("filter", None)
    if where is not None and (not isinstance(where, str) or len(where) > MAX_FILTER_BYTES):
        raise WireError(f"filter must be a JSON string of at most {MAX_FILTER_BYTES} bytes")
    trace = params.pop("traceparent", None)
    if trace is not None and (not isinstance(trace, str) or parse_traceparent(trace) is None):
        raise WireError("traceparent must be a W3C version-00 traceparent")
    limit = {"nprobe": bounds.nlist, "efSearch": MAX_EF_SEARCH}
    for key, value in params.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit[key]:
            raise WireError(f"param {key} must be an integer in 1..{limit[key]}")
    return {**params, **({} if where is None else {"filter": where}),
            **({} if trace is None else {"traceparent": trace})}


def encode_answer(distances: np.ndarray, ids: np.ndarray, search_ms: float, matched: int = 0,
                  position: int = 0) -> bytes:
    """A shard's answer bytes; `position`: the write-log position its answer is the state at (the
    router's merge keeps an id's copy from the newest position: shardserve.query.merge)."""
    n, k = ids.shape
    return b"".join([_ANSWER.pack(_ANSWER_MAGIC, n, k, search_ms, matched, position),
                     np.ascontiguousarray(distances, np.float32).tobytes(),
                     np.ascontiguousarray(ids, np.int64).tobytes()])


def decode_answer(blob: bytes) -> tuple[np.ndarray, np.ndarray, float, int, int]:
    """(distances, ids, search ms, rows a filter matched, log position) from a shard's answer bytes
    (views, no copy)."""
    if blob[:4] == _ANSWER_V2_MAGIC:  # a shard of the release before (a rolling update): no position
        magic, n, k, search_ms, matched = _ANSWER_V2.unpack_from(blob)
        position, header = 0, _ANSWER_V2.size
    else:
        magic, n, k, search_ms, matched, position = _ANSWER.unpack_from(blob)
        header = _ANSWER.size
    if magic not in (_ANSWER_MAGIC, _ANSWER_V2_MAGIC):
        raise WireError(f"not a shard answer (magic {magic!r})")
    distances = np.frombuffer(blob, np.float32, n * k, header).reshape(n, k)
    ids = np.frombuffer(blob, np.int64, n * k, header + 4 * n * k).reshape(n, k)
    return distances, ids, search_ms, matched, position
