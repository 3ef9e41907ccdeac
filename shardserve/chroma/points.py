"""A Chroma record as a native point: its string id hashed to the point's int64 id, and what
Chroma keeps beside the vector (the string id, the document, the uri, the metadata, and for a
cosine collection the vector's norm) in the native collection's string columns.

Why a hash and not a table of ids: a table is a second store a write must reach atomically with
the log; a hash needs nothing. Two string ids of one collection with one hash (2^-63 for a pair:
about 5e-8 across a billion points) would be one point: a write of the second is refused, as the
id stored beside the first says (`collision`), so neither is ever answered for the other.

Why the norm: a native cosine collection stores unit vectors (its index searches by inner
product); Chroma answers the embeddings it was given. The vector times its norm is the vector
given to within a few units in the last place of each component.
"""

from __future__ import annotations

import hashlib

import numpy as np
import orjson

# the native collection's columns: every one a string (Chroma's metadata keys and types come with
# writes; the native columns are fixed at creation)
COLUMNS = {"sid": "string", "doc": "string", "uri": "string", "meta": "string", "seq": "int64"}
ID_MASK = (1 << 63) - 1


def point_id(sid: str) -> int:
    """The native id of Chroma id `sid`: 63 bits of its BLAKE2b digest."""
    return int.from_bytes(hashlib.blake2b(sid.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little") & ID_MASK


def point_ids(sids: list[str]) -> list[int]:
    return [point_id(sid) for sid in sids]


def stored(sid: str, document: str | None, uri: str | None, metadata: dict | None,
           norm: float | None) -> dict:
    """The native metadata row of one record."""
    meta = None
    if metadata is not None or norm is not None:
        meta = orjson.dumps({"m": metadata, **({} if norm is None else {"n": norm})}).decode()
    return {"sid": sid, "doc": document, "uri": uri, "meta": meta}


def metadata_of(row: dict) -> dict | None:
    meta = row.get("meta")
    return None if meta is None else orjson.loads(meta).get("m")


def norm_of(row: dict) -> float | None:
    meta = row.get("meta")
    return None if meta is None else orjson.loads(meta).get("n")


def norms(vectors: np.ndarray) -> np.ndarray:
    """Each vector's L2 norm, computed in float64."""
    return np.linalg.norm(vectors.astype(np.float64), axis=1)


def given(vector: list[float], norm: float | None) -> list[float]:
    """A stored vector as Chroma was given it (a cosine collection's unit vector times its norm)."""
    if norm is None:
        return vector
    return (np.asarray(vector, np.float64) * norm).astype(np.float32).tolist()
