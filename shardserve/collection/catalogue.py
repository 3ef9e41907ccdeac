"""The catalogue: which collections exist, durably, on SQLite (WAL, synchronous=FULL) in the
collections directory, beside each collection's own index directory (`c<id>/`: an index as
`shardserve build` writes one, with its write log).

A collection exists whole or not at all, whatever process is killed when:
- **create** takes the name's lock (an flock on `locks/<name>`, which the kernel releases when its
  process dies), commits its row as `creating` (the name taken), makes its empty index directory,
  then commits the row `live`. A kill before the second commit leaves a `creating` row whose lock
  nobody holds: the next writer to open the catalogue (`recover`) takes the lock, deletes the
  directory and the row, and the name is free again. A creation still under way holds its lock:
  `recover` leaves it alone (no clock decides).
- **drop** commits the row `dropped` (from then on nothing answers it), then deletes its directory
  and its row. A kill between the two: `recover` finishes the deletion.
- A row's id is never reused (AUTOINCREMENT): a name dropped and created again is a new collection
  with a new directory, and nothing of the old one (a replica still holding it, a write in flight)
  can reach it.
Readers (every serving process) open it read-only and see committed rows only.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardserve.collection.spec import CollectionSpec
from shardserve.errors import ShardserveError, WriteLogError

CATALOGUE = "catalogue.sqlite"
BUSY_TIMEOUT_MS = 10_000
PARSED_KEPT = 16_384  # entries whose spec was parsed, kept (then all dropped and parsed again)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS collections (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('creating', 'live', 'dropped')),
    created REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS named ON collections (name) WHERE state != 'dropped';
"""


@contextlib.contextmanager
def file_lock(path: Path, wait: bool) -> Iterator[bool]:
    """An exclusive flock on `path` (made if missing), which the kernel drops when its process
    dies: yields whether it was taken (`wait`: block until it is)."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class NameTaken(ShardserveError):
    """A collection of that name exists (or is being created)."""


@dataclass(frozen=True)
class Entry:
    """A live collection: its id (never reused), its spec, its index directory, when created."""

    id: int
    spec: CollectionSpec
    path: Path
    created: float

    @property
    def name(self) -> str:
        return self.spec.name


class Catalogue:
    """`Catalogue(root)` opens (creating) the catalogue of the collections under `root` to change it;
    `readonly=True` reads what a writer in another process committed. Thread-safe."""

    def __init__(self, root: str | Path, readonly: bool = False):
        self.root = Path(root)
        path = self.root / CATALOGUE
        if readonly:
            self._db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, isolation_level=None,
                                       check_same_thread=False)
            self._db.execute("PRAGMA query_only = ON")
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            if self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise WriteLogError(f"catalogue {path}: SQLite refused WAL mode (a network filesystem?)")
            self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self._db.execute("PRAGMA synchronous = FULL")
        self._lock = threading.Lock()
        self._parsed: dict[int, Entry] = {}
        if not readonly:
            self.recover()

    def path_of(self, collection_id: int) -> Path:
        return self.root / f"c{collection_id}"

    def create(self, spec: CollectionSpec, make: Callable[[Path, CollectionSpec], Any]) -> Entry:
        """Create `spec`'s collection: its name taken, `make(directory, spec)` writes its empty index
        there, then it is live. NameTaken if the name is; whatever `make` raises, nothing is left."""
        created = time.time()
        with self._name_lock(spec.name, wait=True):
            collection_id = self._insert(spec, created)
            directory = self.path_of(collection_id)
            try:
                make(directory, spec)
                with self._lock:
                    self._db.execute("UPDATE collections SET state = 'live' WHERE id = ?", (collection_id,))
            except BaseException:
                self._forget(collection_id)
                raise
        return Entry(collection_id, spec, directory, created)

    def _insert(self, spec: CollectionSpec, created: float) -> int:
        """The new collection's row, `creating` (caller holds the name's lock: a `creating` row of
        that name is then a dead creator's, cleared first)."""
        for _ in range(2):
            with self._lock:
                try:
                    return int(self._db.execute("INSERT INTO collections (name, spec, state, created) VALUES "
                                                "(?, ?, 'creating', ?) RETURNING id",
                                                (spec.name, spec.model_dump_json(), created)).fetchone()[0])
                except sqlite3.IntegrityError:
                    row = self._db.execute("SELECT id FROM collections WHERE name = ? AND state = 'creating'",
                                           (spec.name,)).fetchone()
            if row is None:
                break
            self._forget(int(row[0]))
        raise NameTaken(f"a collection named {spec.name!r} exists")

    def _name_lock(self, name: str, wait: bool) -> contextlib.AbstractContextManager[bool]:
        """The name's creation lock (yields whether it was taken; `wait`: block until it is)."""
        locks = self.root / "locks"
        locks.mkdir(exist_ok=True)
        return file_lock(locks / name, wait)

    def drop(self, name: str) -> Entry | None:
        """Drop the live collection `name` (None: there is none): gone for every reader at once, its
        directory deleted after."""
        with self._lock:
            row = self._db.execute("UPDATE collections SET state = 'dropped' WHERE name = ? AND "
                                   "state = 'live' RETURNING id, spec, created", (name,)).fetchone()
        if row is None:
            return None
        entry = self._entry(row)
        self._forget(entry.id)
        return entry

    def get(self, name: str) -> Entry | None:
        """The live collection `name`, or None. One lookup in the names' index (every request to a
        collection makes it: a dropped one must be seen at once), its spec parsed once per id."""
        with self._lock:
            row = self._db.execute("SELECT id, state, spec, created FROM collections "
                                   "WHERE name = ? AND state != 'dropped'", (name,)).fetchone()
        if row is None or row[1] != "live":
            return None
        return self._entry((row[0], row[2], row[3]))

    def live(self) -> list[Entry]:
        """Every live collection, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT id, spec, created FROM collections WHERE state = 'live' "
                                    "ORDER BY id").fetchall()
        return [self._entry(row) for row in rows]

    def recover(self) -> list[int]:
        """Finish what a killed process left: collections half dropped, and half created by a
        process that is gone (nobody holds the name's lock), lose their directory and their row; a
        directory no row names (a killed creation's, cleared before) goes too. The ids cleared."""
        with self._lock:
            rows = self._db.execute("SELECT id, name, state FROM collections "
                                    "WHERE state != 'live'").fetchall()
        cleared = []
        for collection_id, name, state in rows:
            if state == "creating":
                with self._name_lock(name, wait=False) as taken:
                    # its creator is gone (the kernel released its lock), unless it finished
                    # between the read above and the lock: then the row is live, and kept
                    if not taken or not self._abandon(int(collection_id)):
                        continue
            self._forget(int(collection_id))
            cleared.append(int(collection_id))
        # directories listed first, rows read after: a directory exists only once its row does (a
        # creation writes its row, then makes it), so one made meanwhile is named by the read
        directories = [d for d in self.root.glob("c[0-9]*") if d.name[1:].isdigit()]
        with self._lock:
            named = {int(row[0]) for row in self._db.execute("SELECT id FROM collections").fetchall()}
        for directory in directories:
            if int(directory.name[1:]) not in named:
                shutil.rmtree(directory, ignore_errors=True)
        return cleared

    def _abandon(self, collection_id: int) -> bool:
        """Mark a `creating` row whose creator is gone as dropped (False: it is live by now)."""
        with self._lock:
            row = self._db.execute("UPDATE collections SET state = 'dropped' WHERE id = ? AND "
                                   "state = 'creating' RETURNING id", (collection_id,)).fetchone()
        return row is not None

    def _forget(self, collection_id: int) -> None:
        shutil.rmtree(self.path_of(collection_id), ignore_errors=True)
        with self._lock:
            self._db.execute("DELETE FROM collections WHERE id = ? AND state != 'live'", (collection_id,))

    def _entry(self, row: tuple) -> Entry:
        collection_id, spec, created = row
        number = int(collection_id)
        entry = self._parsed.get(number)  # ids are never reused: a spec parsed once is that id's for good
        if entry is None:
            entry = Entry(number, CollectionSpec.model_validate_json(spec), self.path_of(number),
                          float(created))
            if len(self._parsed) >= PARSED_KEPT:
                self._parsed.clear()
            self._parsed[number] = entry
        return entry

    def close(self) -> None:
        with self._lock:
            self._db.close()
