"""What a collection is: its name, its vectors (dimension, metric), its metadata columns and their
kinds, its shard count, and the index it is built as once it grows (its growth threshold).

Every field comes from a request: each is checked here, before FAISS, SQLite or a path sees it.
A name is 3 to 63 characters, letters, digits, `_`, `-` and `.`, starting and ending with a letter or
digit (Chroma's rule): never a path, never a SQL fragment. An index kind is one of a few FAISS
factory shapes with bounded numbers, matched by a regular expression before FAISS parses it.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shardserve.errors import BadArgument
from shardserve.index.metadata import FLOAT_KINDS, ID, INTEGER_KINDS

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{1,61}[A-Za-z0-9]")
COLUMN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
KINDS = frozenset({"string", "bool", *FLOAT_KINDS, *INTEGER_KINDS})
# Index kinds a collection may grow into: `auto` (chosen by its size), flat, HNSW, IVF flat, IVF-PQ
# fast scan refined by its vectors; numbers bounded (lists, links, sub-quantizers).
INDEX = re.compile(r"auto|Flat|HNSW(?:[4-9]|[1-5][0-9]|6[0-4])(?:,Flat)?|IVF[1-9][0-9]{0,5},Flat"
                   r"|IVF[1-9][0-9]{0,5},PQ[1-9][0-9]{0,3}x4fs,RFlat")
MAX_DIM = 8192
MAX_SHARDS = 64
MAX_COLUMNS = 64
GROW_AT = 20_000  # rows at which a collection served exactly is built as its index
APART_AT = 200_000  # points at which a built collection gets shard deployments of its own


class CollectionSpec(BaseModel):
    """A collection as created (`POST /v1/collections`). Immutable once created."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="3-63 characters: letters, digits, _ - and ., starting and ending "
                                  "with a letter or digit")
    dim: int = Field(ge=1, le=MAX_DIM, description="the vectors' dimension")
    metric: Literal["l2", "ip", "cosine"] = "l2"
    shards: int = Field(1, ge=1, le=MAX_SHARDS, description="shards once built (served as one while small)")
    metadata: dict[str, str] = Field(default_factory=dict, description="metadata column -> kind (string, "
                                     "bool, number, float32, int8..int64, uint8..uint64)")
    index: str = Field("auto", description="what it is built as past `grow_at` rows: auto, Flat, HNSWm, "
                                           "IVFn,Flat or IVFn,PQmx4fs,RFlat")
    grow_at: int = Field(GROW_AT, ge=1_000, le=10_000_000,
                         description="rows past which it is built as `index` (served exactly below)")
    apart_at: int = Field(APART_AT, ge=1_000, le=1_000_000_000,
                          description="points past which, once built, it is served by shard deployments of "
                                      "its own (replicas, autoscaling) instead of by the router replicas")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not NAME.fullmatch(name):
            raise BadArgument("a collection name is 3-63 characters: letters, digits, _ - and ., starting "
                             "and ending with a letter or digit")
        return name

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, columns: dict[str, str]) -> dict[str, str]:
        if len(columns) > MAX_COLUMNS:
            raise BadArgument(f"at most {MAX_COLUMNS} metadata columns")
        for column, kind in columns.items():
            if column == ID:
                raise BadArgument(f"column {ID!r} is reserved: a point's id is its own field")
            if not COLUMN.fullmatch(column):
                raise BadArgument(f"column {column[:80]!r}: 1-64 letters, digits and _, not starting with a "
                                 "digit")
            if kind not in KINDS:
                raise BadArgument(f"column {column!r}: kind {kind[:40]!r} is not one of {sorted(KINDS)}")
        return columns

    @field_validator("index")
    @classmethod
    def _index(cls, index: str) -> str:
        if not INDEX.fullmatch(index):
            raise BadArgument("index is auto, Flat, HNSW4..64, IVFn,Flat or IVFn,PQmx4fs,RFlat")
        return index
