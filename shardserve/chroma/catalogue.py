"""Chroma's names: tenants, databases and collections (each a uuid, a name in its database, its
metadata and configuration), durably, on SQLite (WAL, synchronous=FULL) in the collections directory.

A Chroma collection's points live in a native collection named `chroma-<uuid hex>` (`native_name`),
created at its first write, when the dimension is known (Chroma sets it then). What is here is only
what Chroma names: creating a Chroma collection is one committed row, and so is dropping it (the
native collection is dropped after; a kill between leaves a native collection no row names, which
`orphans` finds and the front drops: when it opens the catalogue, and after each drop). The names
`chroma-<32 hex>` are reserved: the native API refuses to create one.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import orjson

from shardserve.errors import WriteLogError

CATALOGUE = "chroma.sqlite"
BUSY_TIMEOUT_MS = 10_000
DEFAULT_TENANT = "default_tenant"
DEFAULT_DATABASE = "default_database"
NATIVE_PREFIX = "chroma-"
MAX_NAMES = 10_000  # tenants, and databases, a server holds at most (each name at most 512 characters)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (name TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS databases (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    UNIQUE (tenant, name)
);
CREATE TABLE IF NOT EXISTS collections (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    database TEXT NOT NULL,
    name TEXT NOT NULL,
    metadata TEXT,
    configuration TEXT NOT NULL,
    created REAL NOT NULL,
    dim INTEGER,
    UNIQUE (tenant, database, name)
);
"""
NATIVE = re.compile(r"chroma-[0-9a-f]{32}")  # the native names Chroma's collections take (reserved)


class Exists(Exception):
    """A name taken in its namespace."""


class Missing(Exception):
    """The tenant or database a creation names is not there (deleted meanwhile)."""


@dataclass(frozen=True)
class ChromaCollection:
    id: str  # a uuid, as Chroma prints it
    tenant: str
    database: str
    name: str
    metadata: dict | None
    configuration: dict
    dim: int | None = None  # set by its first write, with its native collection

    @property
    def native(self) -> str:
        return native_name(self.id)


def native_name(collection_id: str) -> str:
    """The native collection holding a Chroma collection's points (3-63 characters: a legal name)."""
    return NATIVE_PREFIX + uuid.UUID(collection_id).hex


class ChromaCatalogue:
    """Thread-safe; every call commits before it returns."""

    def __init__(self, root: str | Path):
        path = Path(root) / CATALOGUE
        Path(root).mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        if self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
            raise WriteLogError(f"catalogue {path}: SQLite refused WAL mode (a network filesystem?)")
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO tenants (name) VALUES (?)", (DEFAULT_TENANT,))
            self._db.execute("INSERT OR IGNORE INTO databases (id, tenant, name) VALUES (?, ?, ?)",
                             (str(uuid.uuid5(uuid.NAMESPACE_OID, "default")), DEFAULT_TENANT,
                              DEFAULT_DATABASE))

    # tenants and databases
    def create_tenant(self, name: str) -> None:
        with self._lock:
            if self._db.execute("SELECT count(*) FROM tenants").fetchone()[0] >= MAX_NAMES:
                raise Exists(f"this server holds its maximum of {MAX_NAMES} tenants")
            try:
                self._db.execute("INSERT INTO tenants (name) VALUES (?)", (name,))
            except sqlite3.IntegrityError:
                raise Exists(f"tenant {name} already exists") from None

    def tenant(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM tenants WHERE name = ?", (name,)).fetchone() is not None

    def create_database(self, tenant: str, name: str) -> str:
        database_id = str(uuid.uuid4())
        with self._lock:
            if self._db.execute("SELECT 1 FROM tenants WHERE name = ?", (tenant,)).fetchone() is None:
                raise Missing(f"Tenant [{tenant}] not found")
            if self._db.execute("SELECT count(*) FROM databases").fetchone()[0] >= MAX_NAMES:
                raise Exists(f"this server holds its maximum of {MAX_NAMES} databases")
            try:
                self._db.execute("INSERT INTO databases (id, tenant, name) VALUES (?, ?, ?)",
                                 (database_id, tenant, name))
            except sqlite3.IntegrityError:
                raise Exists(f"Database [{name}] already exists") from None
        return database_id

    def database(self, tenant: str, name: str) -> str | None:
        """The database's id, or None."""
        with self._lock:
            row = self._db.execute("SELECT id FROM databases WHERE tenant = ? AND name = ?",
                                   (tenant, name)).fetchone()
        return None if row is None else str(row[0])

    def databases(self, tenant: str, limit: int | None, offset: int) -> list[tuple[str, str]]:
        with self._lock:
            rows = self._db.execute("SELECT id, name FROM databases WHERE tenant = ? ORDER BY rowid "
                                    "LIMIT ? OFFSET ?", (tenant, -1 if limit is None else limit,
                                                         offset)).fetchall()
        return [(str(a), str(b)) for a, b in rows]

    def delete_database(self, tenant: str, name: str) -> list[ChromaCollection] | None:
        """Delete the database and its collections' rows: the collections deleted (their native
        collections are the caller's to drop), or None when there is no such database."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                gone = self._db.execute("DELETE FROM databases WHERE tenant = ? AND name = ? RETURNING id",
                                        (tenant, name)).fetchone()
                rows = [] if gone is None else self._db.execute(
                    "DELETE FROM collections WHERE tenant = ? AND database = ? RETURNING " + _COLUMNS,
                    (tenant, name)).fetchall()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return None if gone is None else [_collection(row) for row in rows]

    # collections
    def create(self, tenant: str, database: str, name: str, metadata: dict | None, configuration: dict,
               existing: bool = False, at_most: int | None = None) -> ChromaCollection:
        """A new collection (Exists if the name is taken, unless `existing`: then that one), in one
        transaction with the check that its database is there (Missing otherwise: a database
        deleted meanwhile takes no collection) and that fewer than `at_most` exist."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if self._db.execute("SELECT 1 FROM databases WHERE tenant = ? AND name = ?",
                                    (tenant, database)).fetchone() is None:
                    raise Missing(f"Database [{database}] not found")
                row = self._db.execute(f"SELECT {_COLUMNS} FROM collections WHERE tenant = ? AND "
                                       "database = ? AND name = ?", (tenant, database, name)).fetchone()
                if row is not None and not existing:
                    raise Exists(f"Collection [{name}] already exists")
                if row is None:
                    if at_most is not None and self._db.execute(
                            "SELECT count(*) FROM collections").fetchone()[0] >= at_most:
                        raise Exists(f"this server holds its maximum of {at_most} collections")
                    row = self._db.execute(
                        "INSERT INTO collections (id, tenant, database, name, metadata, configuration, "
                        f"created) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING {_COLUMNS}",
                        (str(uuid.uuid4()), tenant, database, name, _dumped(metadata),
                         orjson.dumps(configuration).decode(), time.time())).fetchone()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return _collection(row)

    def set_dim(self, collection_id: str, dim: int) -> bool:
        """Record the dimension its first write set (False: the collection is gone)."""
        with self._lock:
            return self._db.execute("UPDATE collections SET dim = ? WHERE id = ? RETURNING id",
                                    (dim, collection_id)).fetchone() is not None

    def named(self, tenant: str, database: str, name: str) -> ChromaCollection | None:
        return self._one("tenant = ? AND database = ? AND name = ?", (tenant, database, name))

    def get(self, collection_id: str) -> ChromaCollection | None:
        return self._one("id = ?", (collection_id,))

    def listed(self, tenant: str, database: str, limit: int | None, offset: int) -> list[ChromaCollection]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM collections WHERE tenant = ? AND database = ? "
                                    "ORDER BY created, id LIMIT ? OFFSET ?",
                                    (tenant, database, -1 if limit is None else limit, offset)).fetchall()
        return [_collection(row) for row in rows]

    def counted(self, tenant: str, database: str) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM collections WHERE tenant = ? AND database = ?",
                                        (tenant, database)).fetchone()[0])

    def modify(self, collection_id: str, name: str | None, metadata: dict | None,
               configuration: dict | None) -> bool:
        """One transaction; False when the collection is gone."""
        with self._lock:
            try:
                row = self._db.execute(
                    "UPDATE collections SET name = coalesce(?, name), metadata = coalesce(?, metadata), "
                    "configuration = coalesce(?, configuration) WHERE id = ? RETURNING id",
                    (name, _dumped(metadata), None if configuration is None else
                     orjson.dumps(configuration).decode(), collection_id)).fetchone()
            except sqlite3.IntegrityError:
                raise Exists(f"Collection [{name}] already exists") from None
        return row is not None

    def delete(self, collection_id: str) -> ChromaCollection | None:
        with self._lock:
            row = self._db.execute(f"DELETE FROM collections WHERE id = ? RETURNING {_COLUMNS}",
                                   (collection_id,)).fetchone()
        return None if row is None else _collection(row)

    def reset(self) -> list[ChromaCollection]:
        """Every tenant, database and collection gone but the defaults: the collections deleted."""
        with self._lock:
            rows = self._db.execute(f"DELETE FROM collections RETURNING {_COLUMNS}").fetchall()
            self._db.execute("DELETE FROM databases WHERE NOT (tenant = ? AND name = ?)",
                             (DEFAULT_TENANT, DEFAULT_DATABASE))
            self._db.execute("DELETE FROM tenants WHERE name != ?", (DEFAULT_TENANT,))
        return [_collection(row) for row in rows]

    def orphans(self, natives: list[str]) -> list[str]:
        """Among native collection names, those of Chroma collections no row names any more."""
        ours = [name for name in natives if NATIVE.fullmatch(name)]
        with self._lock:
            live = {native_name(str(row[0])) for row in self._db.execute("SELECT id FROM collections")}
        return [name for name in ours if name not in live]

    def stale(self, ids: list[str]) -> list[str]:
        """Among collection ids, those no row names any more (their write locks may go)."""
        with self._lock:
            live = {str(row[0]) for row in self._db.execute("SELECT id FROM collections")}
        return [collection_id for collection_id in ids if collection_id not in live]

    def _one(self, where: str, args: tuple) -> ChromaCollection | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM collections WHERE {where}", args).fetchone()
        return None if row is None else _collection(row)

    def close(self) -> None:
        with self._lock:
            self._db.close()


_COLUMNS = "id, tenant, database, name, metadata, configuration, dim"


def _dumped(metadata: dict | None) -> str | None:
    return None if metadata is None else orjson.dumps(metadata).decode()


def _collection(row: tuple) -> ChromaCollection:
    collection_id, tenant, database, name, metadata, configuration, dim = row
    return ChromaCollection(str(collection_id), str(tenant), str(database), str(name),
                            None if metadata is None else orjson.loads(metadata), orjson.loads(configuration),
                            None if dim is None else int(dim))
