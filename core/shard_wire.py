"""What the router sends a shard and gets back, as raw bytes: one encoding per batch, not per shard.

Why bytes and not numpy objects through Serve's serializer: a query batch is encoded once and the
same buffer goes to every shard; the shard maps it with `np.frombuffer` (no copy, no pickle of array
objects), and its answer comes back the same way. The hop then costs a memcpy, not a serializer.

Layout (little-endian): a fixed header, the float32 (n, dim) matrix, then — when the router already
ran the IVF coarse quantizer — the int64 (n, nprobe) list numbers and float32 (n, nprobe) coarse
distances, then the search params as JSON.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import orjson

_QUERY = struct.Struct("<4sIIIII")  # magic, n, dim, k, nprobe of the assignment (0 = none), params len
_ANSWER = struct.Struct("<4sIId")  # magic, n, k, search milliseconds
_QUERY_MAGIC, _ANSWER_MAGIC = b"SSQ1", b"SSA1"


@dataclass
class ShardQuery:
    """One batch as every shard sees it. `assign`/`coarse`: the IVF lists each query probes and
    their coarse distances, computed once by the router (None: the shard runs its own quantizer)."""

    matrix: np.ndarray
    k: int
    params: dict
    assign: np.ndarray | None = None
    coarse: np.ndarray | None = None
    _encoded: bytes | None = field(default=None, repr=False, compare=False)

    def encode(self) -> bytes:
        """The wire bytes, built once however many shards the batch goes to."""
        if self._encoded is None:
            n, dim = self.matrix.shape
            nprobe = 0 if self.assign is None else self.assign.shape[1]
            params = orjson.dumps(self.params) if self.params else b""
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
        """Query rows of an encoded batch, read from its header alone."""
        return _QUERY.unpack_from(blob)[1]

    @classmethod
    def decode(cls, blob: bytes) -> ShardQuery:
        magic, n, dim, k, nprobe, params_len = _QUERY.unpack_from(blob)
        if magic != _QUERY_MAGIC:
            raise ValueError(f"not a shard query (magic {magic!r})")
        offset = _QUERY.size
        matrix = np.frombuffer(blob, np.float32, n * dim, offset).reshape(n, dim)
        offset += 4 * n * dim
        assign = coarse = None
        if nprobe:
            assign = np.frombuffer(blob, np.int64, n * nprobe, offset).reshape(n, nprobe)
            offset += 8 * n * nprobe
            coarse = np.frombuffer(blob, np.float32, n * nprobe, offset).reshape(n, nprobe)
            offset += 4 * n * nprobe
        params = orjson.loads(blob[offset:offset + params_len]) if params_len else {}
        if offset + params_len != len(blob):
            raise ValueError(f"shard query of {len(blob)} bytes, expected {offset + params_len}")
        return cls(matrix, k, params, assign, coarse)


def encode_answer(distances: np.ndarray, ids: np.ndarray, search_ms: float) -> bytes:
    n, k = ids.shape
    return b"".join([_ANSWER.pack(_ANSWER_MAGIC, n, k, search_ms),
                     np.ascontiguousarray(distances, np.float32).tobytes(),
                     np.ascontiguousarray(ids, np.int64).tobytes()])


def decode_answer(blob: bytes) -> tuple[np.ndarray, np.ndarray, float]:
    """(distances, ids, search ms) from a shard's answer bytes (views, no copy)."""
    magic, n, k, search_ms = _ANSWER.unpack_from(blob)
    if magic != _ANSWER_MAGIC:
        raise ValueError(f"not a shard answer (magic {magic!r})")
    distances = np.frombuffer(blob, np.float32, n * k, _ANSWER.size).reshape(n, k)
    ids = np.frombuffer(blob, np.int64, n * k, _ANSWER.size + 4 * n * k).reshape(n, k)
    return distances, ids, search_ms
