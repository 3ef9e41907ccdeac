"""`manifest.json`: the single file that publishes an index. Written last; read and checked first."""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardserve.errors import BadArgument, ShardserveError
from shardserve.index.storage import Location, sha256_hex

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardEntry(_Strict):
    name: str
    # a file inside the index directory: the path and the digest also name local files (the download
    # cache), so a manifest cannot point outside the directory or choose where bytes are written
    path: str = Field(pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
    num_vectors: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)

    @field_validator("path")
    @classmethod
    def _inside(cls, path: str) -> str:
        if any(part in (".", "..") for part in path.split("/")):
            raise BadArgument(f"path {path!r} leaves the index directory")  # pydantic reports a ValueError
        return path


class MetadataEntry(ShardEntry):
    """A shard's metadata file, and the posting lists (value -> rows) of its categorical columns,
    written at build time beside it (None: an index built before they were, or no such column)."""
    postings: ShardEntry | None = None


class DatasetInfo(_Strict):
    name: str
    fingerprint: str
    # parquet data: where the vectors and the user's ids came from (eval and the swap gate read the
    # same columns). No id column: the index stores row numbers.
    vector_column: str | None = None
    id_column: str | None = None
    metadata_columns: list[str] = []  # returned on request (`include`), stored per shard
    # the filterable ones and what a filter value must be: "number" (floats), "string", "bool" or an
    # integer type ("int64", "uint8", ...: metadata.INTEGER_KINDS; an older build wrote "number")
    metadata_kinds: dict[str, str] = {}
    # built from text (`build --embedder`): the corpus's column the texts came from. `name` is then
    # the parquet files of their vectors the build wrote (`embedding`, `id` and the metadata
    # columns: index_build.embed_corpus), which eval and the swap gate read like any parquet data.
    text_column: str | None = None

    def columns(self) -> dict[str, Any]:
        """`load_dataset` keywords that read the data the way this index's build did."""
        return {"vector_column": self.vector_column, "id_column": self.id_column}


class ModelIdentity(BaseModel):
    """The embedding model an index was built with (shardserve.embed.model_files): what a server
    checks before it embeds a text for this index."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
                        description="over model.onnx, tokenizer.json and the pooling settings")
    dim: int = Field(ge=1)
    metric: Literal["cosine"] = "cosine"
    pooling: Literal["mean"] = "mean"
    normalize: bool = True
    max_tokens: int = Field(ge=2)


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
    # Per shard, its rows' metadata columns (shardserve.index.metadata), when the build was given some.
    metadata: list[MetadataEntry] | None = None
    # The last write-log position this version includes (shardserve.writes.log): 0 for a build from
    # data; a compacted version folds the log up to here, and its shards apply what follows.
    log_position: int = Field(0, ge=0)
    # The model its vectors were embedded with, when it was built from text (`build --embedder`):
    # the server embeds text requests with exactly that model; None: vectors only.
    embedder: ModelIdentity | None = None
    dataset: DatasetInfo
    build: BuildInfo
    created_at: str

    @staticmethod
    def content_version(shards: list[ShardEntry], factory: str, metric: str,
                        metadata: Sequence[ShardEntry] | None = None, log_position: int = 0,
                        embedder: ModelIdentity | None = None) -> str:
        """Index version = hash of what the index answers with: shard contents + how they are read
        (+ the metadata it returns, + where in the write log it starts when not at its beginning:
        the same shards at another position answer with other writes)."""
        digest = hashlib.sha256(f"{factory}|{metric}".encode())
        if log_position:
            digest.update(f"|log {log_position}".encode())
        if embedder is not None:  # the same vectors answer a text through another model otherwise
            digest.update(f"|embedder {embedder.sha256}".encode())
        for shard in [*shards, *(metadata or [])]:
            digest.update(shard.sha256.encode())
        return digest.hexdigest()[:16]


VERSIONS_DIR = "versions"  # versions/<build id>/: one published index version, never changed again
# embedded/<build id>/: the vectors a build from text embedded (parquet), read again by eval, the swap
# gate and every version compacted from that build; kept while a version refers to them
EMBEDDED_DIR = "embedded"


def published(manifest: Manifest, version_dir: str) -> Manifest:
    """The index directory's manifest for a version whose files (and own manifest, with paths
    relative to it) live in `version_dir`."""
    def moved(entry: ShardEntry) -> ShardEntry:
        return entry.model_copy(update={"path": f"{version_dir}/{entry.path}"})

    def moved_metadata(entry: MetadataEntry) -> MetadataEntry:
        return entry.model_copy(update={"path": f"{version_dir}/{entry.path}",
                                        "postings": moved(entry.postings) if entry.postings else None})

    return manifest.model_copy(update={
        "shards": [moved(s) for s in manifest.shards],
        "trained": moved(manifest.trained) if manifest.trained else None,
        "metadata": [moved_metadata(m) for m in manifest.metadata] if manifest.metadata else None})


@dataclass(frozen=True)
class Published:
    """An index as it enters a process, parsed and read once, then passed down typed: where it
    lives (`location`), the immutable directory of the version it publishes now (`version`), and
    that version's manifest. Deployments bind to `version`, so a rebuild of the index (`build
    --force`) never changes what a running or restarted replica reads. An index built before
    version directories existed is its own (mutable) version."""

    location: Location
    version: Location
    manifest: Manifest

    @classmethod
    def open(cls, index: str | Location) -> Published:
        location = Location.of(index)
        manifest = read_manifest(location)
        folders = {posixpath.dirname(s.path) for s in manifest.shards}
        if len(folders) != 1 or not (folder := folders.pop()).startswith(f"{VERSIONS_DIR}/"):
            return cls(location, location, manifest)
        pinned = location.child(folder)
        version = read_manifest(pinned)
        if version.index_version != manifest.index_version:
            raise ShardserveError(f"{pinned.uri}: holds another version than {location.uri}/{MANIFEST} names")
        return cls(location, pinned, version)


def pinned_location(index: str) -> str:
    """The URI of `Published.open(index).version`: what a deployment's arguments carry."""
    return Published.open(index).version.uri


def read_version(location: Location, index_version: str | None) -> Manifest:
    """The manifest at `location`, refused if it is not the version a replica was deployed for
    (an index rebuilt in place under a running deployment)."""
    manifest = read_manifest(location)
    if index_version is not None and manifest.index_version != index_version:
        raise ShardserveError(f"{location.uri} now holds index version {manifest.index_version}, not "
                              f"{index_version} this deployment serves: refusing to mix two indexes "
                              "(rebuilt in place? build into a new directory, then `shardserve swap`)")
    return manifest


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
    _refuse_unless(shard, location, sha256_hex(data), len(data))
    return data


def shard_file_checked(location: Location, shard: ShardEntry, cache_dir: str) -> str:
    """A local path holding the shard file's published bytes, checked against the manifest's
    sha256 without reading the file into memory: the file itself when the index is on this
    machine, else a copy downloaded into `cache_dir` (per version, shared by every replica on the
    node, written under a temporary name and renamed, so a half-download is never used). What a
    replica memory-maps: its pages then live in the page cache, once per node."""
    import os
    import tempfile

    local = location.local_path(shard.path)
    if local is None:
        local = os.path.join(cache_dir, shard.sha256[:16], os.path.basename(shard.path))
        if not os.path.exists(local):
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=os.path.dirname(local), delete=False) as part:
                try:
                    digest, size = location.hash_and_copy(shard.path, part)
                except BaseException:  # a failed download leaves nothing behind
                    os.unlink(part.name)
                    raise
            _refuse_unless(shard, location, digest, size, lambda: os.unlink(part.name))
            os.replace(part.name, local)
            return local
        location = Location.parse(os.path.dirname(local))
        shard = shard.model_copy(update={"path": os.path.basename(local)})
    digest, size = location.hash_and_copy(shard.path)
    _refuse_unless(shard, location, digest, size)
    return local


def _refuse_unless(shard: ShardEntry, location: Location, digest: str, size: int, cleanup=None) -> None:
    if size != shard.bytes or digest != shard.sha256:
        if cleanup is not None:
            cleanup()
        raise ShardserveError(
            f"shard {shard.name} ({location.uri}/{shard.path}): sha256 mismatch with the manifest "
            "(file corrupted or replaced); rebuild the index"
        )
