"""Index locations on any pyarrow filesystem (local path, s3://, gs://, ...)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import posixpath
import uuid
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from shardserve import settings
from shardserve.errors import ShardserveError


def cache_root() -> str:
    """Where a node keeps what it downloads or computes once (shards of a remote index, exact
    ground truth): $SHARDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/shardserve, else ~/.cache/shardserve."""
    return settings.cache_dir()


@dataclass(frozen=True)
class Location:
    """A directory on a filesystem: `fs` + `root`; every file inside is addressed relative to it."""

    fs: pafs.FileSystem
    root: str
    uri: str

    @classmethod
    def of(cls, index: str | Location) -> Location:
        """`index` itself when already parsed, else `Location.parse(index)`."""
        return index if isinstance(index, Location) else cls.parse(index)

    @classmethod
    def parse(cls, uri: str) -> Location:
        try:
            if "://" in uri:
                fs, root = pafs.FileSystem.from_uri(uri)
            else:
                import os

                fs, root = pafs.LocalFileSystem(), os.path.abspath(uri)
        except (pa.ArrowInvalid, OSError, ValueError) as exc:
            raise ShardserveError(f"cannot open index location {uri!r}: {exc}") from None
        return cls(fs, root.rstrip("/") or "/", uri)

    def path(self, relative: str) -> str:
        """Join a manifest-relative path, refusing anything that escapes the index directory."""
        if relative.startswith("/") or "\\" in relative or ".." in relative.split("/"):
            raise ShardserveError(f"path {relative!r} escapes the index directory")
        return posixpath.join(self.root, relative)

    def child(self, relative: str) -> Location:
        """The directory `relative` inside this one (confined like every manifest path). A URI's query
        (`s3://bucket/idx?endpoint_override=…`: filesystem options) stays at the end."""
        base, mark, query = self.uri.partition("?")
        return dataclasses.replace(self, root=self.path(relative),
                                   uri=f"{base.rstrip('/')}/{relative}{mark}{query}")

    def delete_dir(self, only_if_empty: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            if only_if_empty and self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True)):
                return
            self.fs.delete_dir(self.root)

    def exists(self, relative: str) -> bool:
        return self.fs.get_file_info(self.path(relative)).type != pafs.FileType.NotFound

    def read_bytes(self, relative: str) -> bytes:
        try:
            with self.fs.open_input_stream(self.path(relative)) as stream:
                return stream.read()
        except (FileNotFoundError, OSError) as exc:
            raise ShardserveError(f"cannot read {self.uri}/{relative}: {exc}") from None

    def local_path(self, relative: str) -> str | None:
        """The file's path on this machine's filesystem, or None for remote storage (s3://, ...)."""
        return self.path(relative) if isinstance(self.fs, pafs.LocalFileSystem) else None

    def hash_and_copy(self, relative: str, sink=None, chunk_bytes: int = 8 << 20) -> tuple[str, int]:
        """sha256 and size of a file, read in chunks (never whole in memory); each chunk is also
        written to `sink` when one is given (a download that proves what it downloaded)."""
        digest, size = hashlib.sha256(), 0
        try:
            with self.fs.open_input_stream(self.path(relative)) as stream:
                while chunk := stream.read(chunk_bytes):
                    digest.update(chunk)
                    size += len(chunk)
                    if sink is not None:
                        sink.write(chunk)
        except (FileNotFoundError, OSError) as exc:
            raise ShardserveError(f"cannot read {self.uri}/{relative}: {exc}") from None
        return digest.hexdigest(), size

    def write_bytes(self, relative: str, data: bytes) -> None:
        with self.fs.open_output_stream(self.path(relative)) as stream:
            stream.write(data)

    def write_atomically(self, relative: str, data: bytes) -> None:
        """Write to a temporary name, then rename: readers see the old file or the whole new one."""
        tmp = f"{relative}.tmp-{uuid.uuid4().hex[:8]}"
        self.write_bytes(tmp, data)
        try:
            self.fs.move(self.path(tmp), self.path(relative))
        except Exception:
            self.delete(tmp)
            raise

    def delete(self, relative: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.delete_file(self.path(relative))

    def ensure_writable(self) -> None:
        """Create the directory and prove a file can be written there, before any work is done."""
        probe = f".write-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.create_dir(self.root, recursive=True)
            self.write_bytes(probe, b"ok")
        except OSError as exc:
            raise ShardserveError(f"--out {self.uri} is not writable: {exc}") from None
        self.delete(probe)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
