"""Where an index's write log lives, and opening it: the SQLite file beside a local index's
manifest (`shardserve serve`, nothing to deploy), or, when `SHARDSERVE_WRITE_LOG` names a Redis,
a stream in it (a cluster: the log outlives any Ray node, and an index on s3:// takes writes).

Every process that touches the log (the routers append, the shard replicas and the compactor
read, `shardserve compact` truncates) resolves it the same way from the index location, so they
agree without passing it around: on a cluster, set the variable (and the password file's) on
every node.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from shardserve import settings
from shardserve.index.manifest import VERSIONS_DIR
from shardserve.index.storage import Location
from shardserve.writes.log import WriteLog, log_path
from shardserve.writes.redis_log import RedisLogAddress, RedisWriteLog

LogAddress = Path | RedisLogAddress
Log = WriteLog | RedisWriteLog


def index_root(index: str | Location) -> str:
    """The index's own location (its directory, even when `index` names one of its published
    versions), as one canonical string: what a Redis log is keyed by."""
    location = Location.of(index)
    root = location.root if "://" in location.uri else os.path.realpath(location.root)
    if posixpath.basename(posixpath.dirname(root)) == VERSIONS_DIR:
        root = posixpath.dirname(posixpath.dirname(root))
    scheme = location.uri.split("://", 1)[0] if "://" in location.uri else "file"
    return f"{scheme}://{root}"


def log_address(index: str | Location) -> LogAddress | None:
    """Where the log of `index` lives; None when it has none (an index on remote storage and no
    Redis configured: writes are refused)."""
    url = settings.write_log_url()
    if url:
        return RedisLogAddress.for_index(url, index_root(index))
    return log_path(index)


def open_log(address: LogAddress, readonly: bool = False, create: bool = True) -> Log:
    """The log at `address`; `create` False: a SQLite log must exist already (a collection's, which
    its creation made: a write racing its drop never makes its directory again)."""
    if isinstance(address, RedisLogAddress):
        return RedisWriteLog(address, readonly=readonly)
    return WriteLog(address, readonly=readonly, create=create)


def log_exists(address: LogAddress | None) -> bool:
    """Whether anything was ever written to the log at `address`."""
    if address is None:
        return False
    if isinstance(address, RedisLogAddress):
        log = RedisWriteLog(address, readonly=True)
        try:
            return log.exists()
        finally:
            log.close()
    return address.exists()
