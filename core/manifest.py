"""`manifest.json`: the single file that publishes an index. Written last; read and checked first."""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, ValidationError

from core.errors import ShardserveError
from core.storage import Location, sha256_hex

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardEntry(_Strict):
    name: str
    path: str
    num_vectors: int
    sha256: str
    bytes: int


class DatasetInfo(_Strict):
    name: str
    fingerprint: str


class BuildInfo(_Strict):
    params: dict
    seconds: float
    ray_version: str
    faiss_version: str


class Manifest(_Strict):
    format_version: int = FORMAT_VERSION
    index_version: str
    dim: int
    metric: str
    index_factory: str
    num_vectors: int
    shards: list[ShardEntry]
    # The trained, still-empty index every shard was copied from: the router runs its IVF coarse
    # quantizer once per batch for all shards. None in indexes built before it was written.
    trained: ShardEntry | None = None
    dataset: DatasetInfo
    build: BuildInfo
    created_at: str

    @staticmethod
    def content_version(shards: list[ShardEntry], factory: str, metric: str) -> str:
        """Index version = hash of what the index answers with: shard contents + how they are read."""
        digest = hashlib.sha256(f"{factory}|{metric}".encode())
        for shard in shards:
            digest.update(shard.sha256.encode())
        return digest.hexdigest()[:16]


def write_manifest(location: Location, manifest: Manifest) -> None:
    location.write_atomically(MANIFEST, manifest.model_dump_json(indent=2).encode())


def read_manifest(location: Location) -> Manifest:
    if not location.exists(MANIFEST):
        raise ShardserveError(f"{location.uri}: no {MANIFEST} (not an index, or its build did not finish)")
    try:
        manifest = Manifest.model_validate(json.loads(location.read_bytes(MANIFEST)))
    except (ValueError, ValidationError) as exc:
        first = str(exc).splitlines()[0]
        raise ShardserveError(f"{location.uri}/{MANIFEST}: invalid manifest ({first})") from None
    if manifest.format_version != FORMAT_VERSION:
        raise ShardserveError(f"{location.uri}: manifest format {manifest.format_version} is not supported")
    for shard in [*manifest.shards, *([manifest.trained] if manifest.trained else [])]:
        location.path(shard.path)  # confine every shard path to the index directory
    return manifest


def read_shard_checked(location: Location, shard: ShardEntry) -> bytes:
    """The shard file's bytes, after proving they are the bytes the manifest published."""
    data = location.read_bytes(shard.path)
    if len(data) != shard.bytes or sha256_hex(data) != shard.sha256:
        raise ShardserveError(
            f"shard {shard.name} ({location.uri}/{shard.path}): sha256 mismatch with the manifest "
            "(file corrupted or replaced); rebuild the index"
        )
    return data
