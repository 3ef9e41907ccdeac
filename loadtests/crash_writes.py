"""Acknowledged writes survive SIGKILLs, and a 200 is visible at once: the default `shardserve serve`
under a steady load of single upserts, deletes (by id, and by filter) from 3 writers at once (so
the router commits requests in groups) and searches, while a shard replica, the router replica,
every process of the server, or every process of the server while its automatic compaction runs is
killed with SIGKILL (the whole server is then started again with the same command, on the same
index directory). The server compacts on its own every `compact_at`
operations (`--compact-at`), so compactions and their swaps also run beside the other kills.

Throughout, each write's 200 is followed by a search on another connection: an upsert must be found
by its own vector, a deleted id must be absent (read-your-writes). At the end, every acknowledged
upsert still live is found by a search with its own vector, and no acknowledged delete comes back.
A write whose answer never arrived (the process died first) is neither: it may or may not have
been committed, and an id it touched is left out of both checks.

    python -m loadtests.crash_writes --index indexes/fashion-mnist-ivf1024-4 --kills 5
      -> loadtests/records/crash-writes.json

tests/test_writes_served.py runs the same with one kill of each kind.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from loadtests.served import Server
from shardserve.client import Client
from shardserve.errors import ApiError
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location
from shardserve.runtime.ports import free_port

RECORDS = Path(__file__).parent / "records"
NEW_IDS = 1 << 40  # upserted ids start here, far from any base row number
TAG_BASE = 1 << 50  # values of the int64 column that tags the points a delete by filter deletes
KINDS = ("shard", "router", "server", "compaction")
WRITERS = 3  # at once, back to back: requests wait behind each other's fsync and commit in groups
KILL_DELAYS_S = (0.0, 0.5, 1.0, 2.0, 4.0)  # after "compacting" is printed: compaction, swap, gate, switch


@dataclass
class Ledger:
    """What the writers were told: acknowledged upserts (id -> vector), acknowledged deletes, and the
    ids an unanswered write touched (unknown: left out of every check)."""

    upserted: dict[int, np.ndarray] = field(default_factory=dict)
    deleted: dict[int, np.ndarray] = field(default_factory=dict)  # id -> the vector it had
    unknown: set[int] = field(default_factory=set)
    # right after each 200, was the id among its vector's top 10 (None: that search failed, a kill)
    seen_at_once: list[bool | None] = field(default_factory=list)  # upserts
    gone_at_once: list[bool | None] = field(default_factory=list)  # deletes
    refused: dict[str, int] = field(default_factory=dict)
    # per acknowledged delete by filter: (ids it deleted, its tagged upserts acknowledged, sent)
    filter_deletes: list[tuple[int, int, int]] = field(default_factory=list)
    acks: int = 0  # 200s so far, of either kind
    reserved: set[int] = field(default_factory=set)  # tagged for a delete by filter: no other deletes them
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ack(self) -> None:
        with self.lock:
            self.acks += 1

    def acked(self) -> int:
        return self.acks


class Load:
    """`writers` writers (single upserts, every 4th op a delete of an earlier upsert or of a base
    row, and with `tag_column` every 16th a delete by filter of two upserts tagged for it) and one
    searcher, each on connections of its own, until stopped. `writes_per_s`: each writer's pace
    (None: back to back); `searcher`: whether the searcher runs. Several writers back to back keep
    requests waiting behind each other's fsync in the router, so they are committed in groups
    (shardserve.writes.accept), and a kill lands among groups of several requests."""

    def __init__(self, url: str | list[str], dim: int, base: np.ndarray, seed: int = 0,
                 writes_per_s: float | None = None, searcher: bool = True, tag_column: str | None = None,
                 writers: int = 1, collection: str | None = None):
        self.url, self.dim, self.base = url, dim, base
        self.collection = collection  # a collection's routes instead of the served index's
        self.tag_column = tag_column  # an int64 column: every 16th op a delete by filter on it
        self.pause_s = 0.0 if writes_per_s is None else 1.0 / writes_per_s
        self.ledger, self.stopping = Ledger(), threading.Event()
        self.seed, self.searches = seed, 0
        self._ids = itertools.count(NEW_IDS)  # next() is atomic: each id upserted once, by one writer
        self.threads = [threading.Thread(target=self._write, args=(np.random.default_rng(seed + w), 5 * w),
                                         daemon=True) for w in range(writers)]
        if searcher:
            self.threads.append(threading.Thread(target=self._search, daemon=True))

    def start(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def wait_acked(self, more: int, timeout_s: float = 600) -> None:
        """Until `more` writes past now are acknowledged (writes resumed after a kill)."""
        target, deadline = self.ledger.acked() + more, time.monotonic() + timeout_s
        while self.ledger.acked() < target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"writes did not resume: {self.ledger.acked()} of {target} acknowledged")
            time.sleep(0.05)

    def _write(self, rng: np.random.Generator, ops: int) -> None:
        """Back to back from op number `ops` on (writers start apart: their deletes by filter, one at
        a time per router, do not come due together)."""
        writer, reader = _client(self.url, 30, self.collection), _client(self.url, 30, self.collection)
        while not self.stopping.is_set():
            ops += 1
            if ops % 16 == 0 and self.tag_column is not None:
                self._delete_by_filter(writer, reader, rng)
            elif ops % 4 == 0:
                self._delete_one(writer, reader, rng)
            else:
                self._upsert_one(writer, reader, rng)
            if self.pause_s:
                self.stopping.wait(self.pause_s)

    def _upsert_one(self, writer: Client, reader: Client, rng: np.random.Generator,
                    metadata: dict | None = None) -> int | None:
        id_ = next(self._ids)
        vector = (self.base[rng.integers(len(self.base))] + rng.normal(0, 8, self.dim)).astype(np.float32)
        rows: list[dict | None] | None = None if metadata is None else [metadata]
        if not self._acked(lambda: writer.upsert([id_], vector[None], rows), id_):
            return None
        if metadata is not None:  # its delete by filter's: no other writer deletes it before that
            with self.ledger.lock:
                self.ledger.reserved.add(id_)
        # searched before the ledger has it: another writer may delete it only after this search
        self.ledger.seen_at_once.append(self._found(reader, vector, id_))
        with self.ledger.lock:
            self.ledger.upserted[id_] = vector
        return id_

    def _delete_by_filter(self, writer: Client, reader: Client, rng: np.random.Generator) -> None:
        """Two upserts tagged with a label no other point has, then a delete by that filter: its
        200 covers both (when both were acknowledged), and neither may come back."""
        assert self.tag_column is not None
        tag = TAG_BASE + next(self._ids)  # one per pair, far from any value the base holds
        tagged = [self._upsert_one(writer, reader, rng, {self.tag_column: tag}) for _ in range(2)]
        written = [id_ for id_ in tagged if id_ is not None]
        try:
            self._delete_tagged(writer, reader, tag, written, len(tagged))
        finally:
            with self.ledger.lock:
                self.ledger.reserved.difference_update(written)

    def _delete_tagged(self, writer: Client, reader: Client, tag: int, written: list[int], sent: int) -> None:
        assert self.tag_column is not None
        if not written:
            return
        vectors = {id_: self.ledger.upserted[id_] for id_ in written}
        try:
            answer = writer.delete(filter={self.tag_column: tag})
        except ApiError as error:  # refused before the log (503 while restarting, busy): nothing written
            self._refused(f"filter {error.status}")
            return
        except httpx.HTTPError:  # no answer: the tagged ids may or may not be deleted
            with self.ledger.lock:
                for id_ in written:
                    self.ledger.unknown.add(id_)
                    self.ledger.upserted.pop(id_, None)
            time.sleep(0.05)
            return
        self.ledger.ack()
        self.ledger.filter_deletes.append((answer["deleted"], len(written), sent))
        with self.ledger.lock:
            for id_ in written:
                self.ledger.upserted.pop(id_, None)
                self.ledger.deleted[id_] = vectors[id_]
        for id_ in written:
            self.ledger.gone_at_once.append(self._found(reader, vectors[id_], id_))

    def _delete_one(self, writer: Client, reader: Client, rng: np.random.Generator) -> None:
        with self.ledger.lock:
            earlier = [i for i in self.ledger.upserted
                       if i not in self.ledger.unknown and i not in self.ledger.reserved]
            if earlier and rng.random() < 0.5:
                id_ = int(earlier[rng.integers(len(earlier))])
                vector = self.ledger.upserted[id_]
            else:  # a base row
                id_ = int(rng.integers(len(self.base)))
                vector = self.base[id_]
        if id_ in self.ledger.deleted or not self._acked(lambda: writer.delete([id_]), id_):
            return
        with self.ledger.lock:
            self.ledger.upserted.pop(id_, None)
            self.ledger.deleted[id_] = vector
        self.ledger.gone_at_once.append(self._found(reader, vector, id_))

    def _acked(self, send, id_: int) -> bool:
        try:
            send()
            self.ledger.ack()
            return True
        except ApiError as error:  # refused before the log: nothing written (503 while restarting)
            self._refused(str(error.status))
        except httpx.ConnectError:  # never sent: nothing written (the server is down)
            self._refused("no connection")
            time.sleep(0.05)
        except httpx.HTTPError:  # no answer: it may or may not have been committed
            with self.ledger.lock:
                self.ledger.unknown.add(id_)
                self.ledger.upserted.pop(id_, None)
                self.ledger.deleted.pop(id_, None)
            time.sleep(0.05)
        return False

    def _refused(self, why: str) -> None:
        with self.ledger.lock:
            self.ledger.refused[why] = self.ledger.refused.get(why, 0) + 1

    @staticmethod
    def _found(reader: Client, vector: np.ndarray, id_: int) -> bool | None:
        """Is `id_` among the top 10 of its own vector (None: the search failed, a kill meanwhile)."""
        try:
            return bool(id_ in reader.search(vector, k=10, require_full=True).ids)
        except (ApiError, httpx.HTTPError):
            return None

    def _search(self) -> None:
        reader, rng = _client(self.url, 30, self.collection), np.random.default_rng(self.seed + 1000)
        while not self.stopping.is_set():
            try:
                reader.search(self.base[rng.integers(len(self.base))], k=10)
                self.searches += 1
            except (ApiError, httpx.HTTPError):
                time.sleep(0.05)


def _client(url: str | list[str], timeout_s: float, collection: str | None) -> Client:
    client = Client(url, timeout_s=timeout_s)
    return client if collection is None else client.collection(collection)


def check(url: str | list[str], ledger: Ledger, collection: str | None = None) -> dict:
    """After the kills: every acknowledged upsert still live found by its own vector, no
    acknowledged delete answered (ids an unanswered write touched are left out); in `collection`
    when given, else the served index."""
    client = _client(url, 120, collection)
    live = {i: v for i, v in ledger.upserted.items() if i not in ledger.unknown}
    lost, top1 = [], 0
    items = list(live.items())
    for start in range(0, len(items), 256):
        chunk = items[start:start + 256]
        hits = client.search_batch(np.stack([v for _, v in chunk]), k=10, require_full=True)
        for (id_, _), found in zip(chunk, hits, strict=True):
            lost += [] if id_ in found.ids else [id_]
            top1 += int(len(found.ids) > 0 and found.ids[0] == id_)
    gone = sorted(set(ledger.deleted) - ledger.unknown)
    returned = []
    for start in range(0, len(gone), 256):
        ids = gone[start:start + 256]
        hits = client.search_batch(np.stack([ledger.deleted[id_] for id_ in ids]), k=10, require_full=True)
        returned += [id_ for id_, found in zip(ids, hits, strict=True) if id_ in found.ids]
    return {"upserts_checked": len(live), "upserts_lost": lost, "upserts_top1": top1,
            "deletes_checked": len(gone), "deletes_returned": returned}


def run(index: Path, kills: int = 5, writes_between: int = 90, work: Path | None = None,
        port: int | None = None, compact_at: int | None = None, writers: int = WRITERS) -> dict:
    """`kills` of each kind in turn, `writes_between` acknowledged writes before each kill and after
    each recovery, from `writers` writers at once, the server compacting every `compact_at`
    operations (default: 2 × `writes_between`); returns the record."""
    from shardserve.data.datasets import load_dataset

    manifest = read_manifest(Location.parse(str(index)))
    base = load_dataset(manifest.dataset.name, limit=manifest.num_vectors, **manifest.dataset.columns()).base
    work = work or Path(os.environ.get("TMPDIR", "/tmp")) / f"crash-writes-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    flags = ("--compact-at", str(compact_at or 2 * writes_between))
    server = Server(index, port, work / "serve.log", flags)
    events: list[dict] = []
    load: Load | None = None
    try:
        server.wait_healthy()
        tag_column = next((c for c, kind in manifest.dataset.metadata_kinds.items() if kind == "int64"), None)
        load = Load(server.url, manifest.dim, base, tag_column=tag_column, writers=writers).start()
        load.wait_acked(writes_between)
        for round_ in range(kills):
            for kind in KINDS:
                acked = load.ledger.acked()
                started = time.monotonic()
                event: dict = {}
                if kind == "compaction":  # the next automatic compaction: kill it at some stage
                    server.wait_said("compacting", server.said("compacting"))
                    event["after_compacting_s"] = KILL_DELAYS_S[round_ % len(KILL_DELAYS_S)]
                    time.sleep(event["after_compacting_s"])
                    started = time.monotonic()
                if kind in ("server", "compaction"):
                    killed = server.kill_all()
                    server = Server(index, port, work / "serve.log", flags)
                    server.wait_healthy()
                else:
                    pid = server.replica(b"Router" if kind == "router" else b"shard-000")
                    if pid is None:
                        raise RuntimeError(f"no {kind} replica to kill")
                    os.kill(pid, signal.SIGKILL)
                    killed = 1
                load.wait_acked(writes_between)
                events.append({"round": round_, "kind": kind, **event, "processes_killed": killed,
                               "acked_before": acked, "acked_after": load.ledger.acked(),
                               "writes_resumed_after_s": round(time.monotonic() - started, 2)})
        load.stop()
        checked = check(server.url, load.ledger)
    finally:
        if load is not None:
            load.stop()
        server.stop()
    ledger = load.ledger
    return {
        "name": "crash-writes", "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "index": manifest.index_version, "writers": writers,
        "command": f"shardserve serve {index} --port PORT {' '.join(flags)}",
        "compactions_started": server.said("compacting"), "swaps": server.said("compacted and swapped"),
        "kills": events, "upserts_acked": len(ledger.upserted), "deletes_acked": len(ledger.deleted),
        "unknown": len(ledger.unknown), "refused": ledger.refused, "searches": load.searches,
        "filter_deletes": {  # each: (ids deleted, its tagged upserts acknowledged, sent)
            "acked": len(ledger.filter_deletes),
            "deleted_exactly_the_tagged": sum(d == w for d, w, t in ledger.filter_deletes if w == t),
            "all_tagged_acknowledged": sum(w == t for _, w, t in ledger.filter_deletes),
            "outside_the_tagged": sum(not w <= d <= t for d, w, t in ledger.filter_deletes)},
        "read_your_writes": {
            "upserts_found": sum(x is True for x in ledger.seen_at_once),
            "upserts_missed": sum(x is False for x in ledger.seen_at_once),
            "deletes_absent": sum(x is False for x in ledger.gone_at_once),
            "deletes_found": sum(x is True for x in ledger.gone_at_once),
            "searches_failed": sum(x is None for x in ledger.seen_at_once + ledger.gone_at_once)},
        **checked,
    }


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--index", required=True)
    cli.add_argument("--kills", type=int, default=5, help="kills of each kind")
    cli.add_argument("--writes-between", type=int, default=90, help="acknowledged writes before each "
                     "kill and after each recovery (from 3 writers, about the time 30 took one)")
    cli.add_argument("--compact-at", type=int, default=None, help="the server's --compact-at "
                     "(default: 2 x --writes-between)")
    cli.add_argument("--writers", type=int, default=WRITERS, help="writers at once, back to back")
    cli.add_argument("--out", default=str(RECORDS / "crash-writes.json"))
    args = cli.parse_args()
    record = run(Path(args.index), args.kills, args.writes_between, compact_at=args.compact_at,
                 writers=args.writers)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "kills"}, indent=1))


if __name__ == "__main__":
    main()
