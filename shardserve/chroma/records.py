"""Chroma's record operations (add, update, upsert, delete, get, query, count) on one native
collection, through `Native`: the native collections' routes, called in-process (their checks,
write log, forwarding to a collection served apart, fairness), never a second store.

What Chroma asks that the native API does not give is done here:
- **insertion order**: each record carries `seq`, taken when it is first written (a replica's clock,
  made strictly increasing); an update keeps it. A get answers in `seq` order, its limit and offset
  applied after the filters, as Chroma's does.
- **filters over keys that come with writes**: the native columns are fixed at creation, so a
  `where` is evaluated here (shardserve.chroma.where) over the records' stored metadata, and the
  ids it passes are searched among: in-process, as one array the shards select on (`Among`); through
  the routes (a collection served apart), as the native search's `$id` filter in parts of at most
  ID_PART, merged by the one `merge_topk`.
- **merges**: an update or upsert merges metadata key by key (a null value deletes its key) and
  keeps what it does not give; an add of an id held is ignored. Read, merged, written under the
  collection's lock in this replica.
- **distances**: Chroma's (squared L2, 1 - dot, 1 - cosine), computed again in float64 on the
  stored float32 vectors of the k found, so they equal what Chroma's reference computes.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import orjson

from shardserve.chroma import points as P
from shardserve.chroma.where import BadWhere, check, matches
from shardserve.query.filters import Among
from shardserve.query.merge import merge_topk
from shardserve.writes.parse import MAX_METADATA_BYTES, MAX_STRING_BYTES

# (method, route under /v1/collections/{native}, JSON body) -> the decoded answer; raises ApiError
Native = Callable[[str, str, object], Awaitable[object]]
# (query matrix, k, the ids searched among or None for all) -> (distances, ids) from the native
# collection's shards in-process, or None when it is served apart (then its routes answer)
Search = Callable[[np.ndarray, int, Among | None], Awaitable[tuple[np.ndarray, np.ndarray] | None]]
INCLUDABLE = {"documents", "embeddings", "metadatas", "distances", "uris"}
MAX_SCANNED = 200_000  # records a filtered get, delete or query passes over here
MAX_BRUTE = 20_000  # records a query with n_results past the native max_k scores here
MAX_ANSWERED = 100_000  # records one get answers
# ids a native search's `$id` filter names at most: the native check bounds a filter's work by the
# rows the collection may hold (its base and a full write backlog), and 1,024 values pass it to about
# 500,000 rows (filters.MAX_FILTER_WORK, IN_VALUES_PER_PASS)
ID_PART = 1024
MAX_QUERIES_PER = 16_384  # query embeddings one query takes (searched max_vectors at a time)
DIRECT_L2 = 1 << 20  # elements of the difference array the direct squared L2 may make
BRUTE_QUERIES = 64  # queries scored together past max_k (x MAX_BRUTE records x 8 bytes)


class ChromaRefusal(Exception):
    """An answer in Chroma's error shape: its status, its error name, its message."""

    def __init__(self, status: int, name: str, message: str):
        super().__init__(message)
        self.status, self.name, self.message = status, name, message


def invalid(message: str) -> ChromaRefusal:
    return ChromaRefusal(400, "InvalidArgumentError", message)


@dataclass
class Record:
    pid: int
    sid: str
    document: str | None
    uri: str | None
    metadata: dict | None
    seq: int
    vector: list[float] | None = None


@dataclass(frozen=True)
class Limits:
    max_page: int
    max_write_points: int
    max_k: int
    max_vectors: int  # query embeddings per query
    max_batch: int  # records one write takes, ids one get, delete or query names

class ScanCache:
    """A replica's last walks of collections' records and the filters evaluated on them, each kept
    under the log position it is the state at (the native count says the position now: a write
    acknowledged anywhere moves it, and the entry is not used again). Bounded in collections and in
    filters; a filtered get or query of an unchanged collection then costs no walk."""

    def __init__(self, collections: int = 4, filters: int = 64):
        self.collections, self.filters = collections, filters
        self._scans: OrderedDict[str, tuple[int, list]] = OrderedDict()
        self._filtered: OrderedDict[tuple, list] = OrderedDict()

    def scan(self, native: str, position: int) -> list | None:
        kept = self._scans.get(native)
        if kept is None or kept[0] != position:
            return None
        self._scans.move_to_end(native)
        return kept[1]

    def keep_scan(self, native: str, position: int, records: list) -> None:
        self._scans[native] = (position, records)
        self._scans.move_to_end(native)
        while len(self._scans) > self.collections:
            self._scans.popitem(last=False)

    def filtered(self, key: tuple) -> list | None:
        found = self._filtered.get(key)
        if found is not None:
            self._filtered.move_to_end(key)
        return found

    def keep_filtered(self, key: tuple, records: list) -> None:
        self._filtered[key] = records
        while len(self._filtered) > self.filters:
            self._filtered.popitem(last=False)


class Sequencer:
    """Strictly increasing insertion stamps (nanoseconds since the epoch, bumped past the last)."""

    def __init__(self) -> None:
        self.last = 0

    def take(self, n: int) -> list[int]:
        start = max(time.time_ns(), self.last + 1)
        self.last = start + n - 1
        return list(range(start, start + n))


def embeddings_of(value: object, count: int, field: str = "embeddings") -> list[list[float] | None] | None:
    """The request's embeddings: number lists or base64 little-endian float32 (Chroma's two forms)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count:
        raise invalid(f"{field}: expected {count} embeddings")
    out: list[list[float] | None] = []
    for item in value:
        if item is None:
            out.append(None)
        elif isinstance(item, str):
            try:
                raw = base64.b64decode(item, validate=True)
            except ValueError:
                raise invalid(f"{field}: not base64") from None
            if len(raw) % 4:
                raise invalid(f"{field}: base64 of {len(raw)} bytes is not float32s")
            out.append(np.frombuffer(raw, "<f4").astype(np.float64).tolist())
        elif isinstance(item, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                            for x in item):
            out.append([float(x) for x in item])
        else:
            raise invalid(f"{field}: each embedding is a list of numbers or a base64 string")
    for vector in out:
        if vector is not None:
            if not vector:
                raise invalid(f"{field}: an embedding is empty")
            if not all(math.isfinite(x) for x in vector):
                raise invalid(f"{field}: an embedding holds NaN or infinity")
    return out


def _aligned(payload: dict, field: str, count: int) -> list:
    value = payload.get(field)
    if value is None:
        return [None] * count
    if not isinstance(value, list) or len(value) != count:
        raise invalid(f"{field}: expected {count} entries, one per id")
    return value


def _ids(payload: dict, limit: int, required: bool = True) -> list[str] | None:
    ids = payload.get("ids")
    if ids is None and not required:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise invalid("ids: expected a list of non-empty strings")
    if len(ids) > limit:
        raise invalid(f"Batch size {len(ids)} exceeds maximum batch size {limit}")
    if len(set(ids)) != len(ids):
        raise ChromaRefusal(400, "DuplicateIDError", "ids: duplicates in one request")
    pids = P.point_ids(ids)
    if len(set(pids)) != len(pids):  # two ids of one hash: never one answered for the other
        raise ChromaRefusal(409, "ChromaError", "two ids of this request hash to one point: use other ids")
    return ids


def _fits(record: Record) -> None:
    """The native write's own bounds, checked for every record before any is written (a batch is
    refused whole, never written in part)."""
    for name, value in (("id", record.sid), ("document", record.document), ("uri", record.uri)):
        if value is not None and len(value.encode("utf-8", "surrogatepass")) > MAX_STRING_BYTES:
            raise invalid(f"{name} of {record.sid[:40]!r}: more than {MAX_STRING_BYTES} bytes")
    row = P.stored(record.sid, record.document, record.uri, record.metadata, 1.0)
    if row["meta"] is not None and len(row["meta"].encode()) > MAX_STRING_BYTES:
        raise invalid(f"metadata of {record.sid[:40]!r}: more than {MAX_STRING_BYTES} bytes as JSON")
    if len(orjson.dumps(row)) + 32 > MAX_METADATA_BYTES:
        raise invalid(f"record {record.sid[:40]!r}: id, document, uri and metadata over {MAX_METADATA_BYTES} "
                      "bytes")


def _checked_metadata(metadata: object, where: str) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise invalid(f"{where}: expected an object")
    for key, value in metadata.items():
        if not key or key[0] in "#$":
            raise invalid(f"{where}: key {key[:40]!r} is empty or starts with # or $")
        if value is None or isinstance(value, (str, int, float, bool)):
            if isinstance(value, float) and not math.isfinite(value):
                raise invalid(f"{where}: {key!r} is NaN or infinite")
            continue
        if isinstance(value, list) and value and all(isinstance(v, (str, int, float, bool)) for v in value):
            continue
        if isinstance(value, dict) and value.get("#type") == "sparse_vector":
            continue
        raise invalid(f"{where}: {key!r} holds a {type(value).__name__}")
    return metadata


def _fresh(metadata: dict | None) -> dict | None:
    """A new record's metadata: null values dropped, none left is null (Chroma's)."""
    if metadata is None:
        return None
    kept = {k: v for k, v in metadata.items() if v is not None}
    return kept or None


def merged(old: dict | None, new: dict | None) -> dict | None:
    """Chroma's update: keys set, a null deleting its key; no metadata given keeps the old."""
    if new is None:
        return old
    out = dict(old or {})
    for key, value in new.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out or None


class Records:
    """One Chroma collection's records in native collection `native` (None: not written yet, so
    its dimension is not known)."""

    def __init__(self, native: Native, name: str, metric: str, dim: int | None, limits: Limits,
                 sequencer: Sequencer, cache: ScanCache | None = None, key: str = "",
                 search: Search | None = None):
        self.native, self.name, self.metric, self.dim = native, name, metric, dim
        self.limits, self.sequencer, self.cache, self.key = limits, sequencer, cache, key
        self.search = search

    # --- reads of native points
    def _record(self, point: dict) -> Record:
        row = point["metadata"]
        vector = point.get("vector")
        if vector is not None:
            vector = P.given(list(vector), P.norm_of(row))
        return Record(int(point["id"]), row.get("sid") or "", row.get("doc"), row.get("uri"),
                      P.metadata_of(row) if "meta" in row else None, int(row.get("seq") or 0), vector)

    async def held(self, sids: list[str], vectors: bool) -> dict[str, Record]:
        """The records among `sids`, by id (one whose hash another id holds is refused)."""
        found: dict[str, Record] = {}
        if self.dim is None:
            return found
        for start in range(0, len(sids), self.limits.max_page):
            part = sids[start:start + self.limits.max_page]
            pids = dict(zip(P.point_ids(part), part, strict=True))
            answer = await self.native("POST", "points", {"ids": list(pids), "vectors": vectors})
            for point in answer["points"]:  # type: ignore[index]
                record = self._record(point)
                if record.sid != pids[record.pid]:
                    raise _collision(pids[record.pid], record.sid)
                found[record.sid] = record
        return found

    async def scanned(self, columns: list[str] | None = None) -> list[Record]:
        """Every record (`columns`: those read, default all), in insertion order: a walk of the
        native scroll, without vectors (a window's are fetched after)."""
        records: list[Record] = []
        if self.dim is None:
            return records
        after = None
        while True:
            answer = await self.native("POST", "scroll", {"limit": self.limits.max_page, "after": after,
                                                          "include": columns})
            records.extend(self._record(point) for point in answer["points"])  # type: ignore[index]
            if len(records) > MAX_SCANNED:
                raise invalid(f"collection {self.name}: more than {MAX_SCANNED} records to filter here; "
                              "give ids, or use the native API's typed filters")
            after = answer["next"]  # type: ignore[index]
            if after is None:
                break
        records.sort(key=lambda r: (r.seq, r.pid))
        return records

    async def selected(self, ids: list[str] | None, where: dict | None,
                       where_document: dict | None) -> list[Record]:
        """The records passing `ids`, `where` and `where_document`, in insertion order, without
        their vectors. The filters are checked whole first (bounded), then evaluated in a thread."""
        try:
            check(where, where_document)
        except BadWhere as exc:
            raise invalid(str(exc)) from None
        filtered = bool(where or where_document)
        if ids is not None:
            found = await self.held(ids, vectors=False)
            records = sorted(found.values(), key=lambda r: (r.seq, r.pid))
        elif filtered and self.cache is not None and self.dim is not None:
            return await self._cached(where, where_document)
        else:
            records = await self.scanned(None if filtered else ["sid", "seq"])
        if filtered:
            records = await asyncio.to_thread(_passing, records, where, where_document)
        return records

    async def _cached(self, where: dict | None, where_document: dict | None) -> list[Record]:
        """A filter over every record, through the replica's ScanCache: the walk and the filter's
        answer reused while the collection's log position has not moved."""
        assert self.cache is not None
        answer = await self.native("POST", "count", {})
        position = answer.get("position") if isinstance(answer, dict) else None
        if position is None:  # served apart: its answer says no position, nothing is kept
            return await asyncio.to_thread(_passing, await self.scanned(None), where, where_document)
        key = (self.key, position, orjson.dumps([where, where_document], option=orjson.OPT_SORT_KEYS))
        kept = self.cache.filtered(key)
        if kept is not None:
            return kept
        records = self.cache.scan(self.key, position)
        if records is None:
            records = await self.scanned(None)
            self.cache.keep_scan(self.key, position, records)
        found = await asyncio.to_thread(_passing, records, where, where_document)
        self.cache.keep_filtered(key, found)
        return found

    # --- writes
    def _checked_dim(self, vectors: list[list[float] | None]) -> int | None:
        dims = {len(v) for v in vectors if v is not None}
        if len(dims) > 1:
            raise invalid("Inconsistent dimensions in provided embeddings")
        dim = next(iter(dims), None)
        if dim is not None and self.dim is not None and dim != self.dim:
            raise invalid(f"Collection expecting embedding with dimension of {self.dim}, got {dim}")
        return dim

    async def _write(self, records: list[Record]) -> None:
        """One native upsert: one log transaction (max_batch is at most max_write_points)."""
        for start in range(0, len(records), self.limits.max_write_points):
            part = records[start:start + self.limits.max_write_points]
            vectors = np.asarray([r.vector for r in part], np.float32)
            norms = P.norms(vectors) if self.metric == "cosine" else None
            rows = [{**P.stored(r.sid, r.document, r.uri, r.metadata,
                                None if norms is None else float(norms[i])), "seq": r.seq}
                    for i, r in enumerate(part)]
            await self.native("POST", "upsert", {"ids": [r.pid for r in part], "vectors": vectors.tolist(),
                                                 "metadata": rows})

    async def write(self, mode: str, payload: dict, create: Callable[[int], Awaitable[None]]) -> None:
        """add, update or upsert (`mode`) of the request's records. `create(dim)`: makes the native
        collection at the first write (the dimension known then)."""
        ids = _ids(payload, self.limits.max_batch)
        assert ids is not None
        vectors = embeddings_of(payload.get("embeddings"), len(ids))
        metadatas = [_checked_metadata(m, "metadatas") for m in _aligned(payload, "metadatas", len(ids))]
        documents = _aligned(payload, "documents", len(ids))
        uris = _aligned(payload, "uris", len(ids))
        if not all(d is None or isinstance(d, str) for d in documents + uris):
            raise invalid("documents and uris are strings or null")
        if mode != "update" and (vectors is None or any(v is None for v in vectors)):
            raise invalid(f"{mode} needs an embedding for every id")
        dim = None if vectors is None else self._checked_dim(vectors)
        if mode == "update" and self.dim is None:
            return  # nothing held: an update of ids not held does nothing
        for i, sid in enumerate(ids):  # every record within the native bounds before anything is made
            _fits(Record(0, sid, documents[i], uris[i], metadatas[i], 0))
        if self.dim is None:
            assert dim is not None
            await create(dim)
            self.dim = dim
        held = await self.held(ids, vectors=vectors is None or any(v is None for v in vectors))
        fresh = [i for i, sid in enumerate(ids) if sid not in held]
        stamps = iter(self.sequencer.take(len(fresh)))
        writes: list[Record] = []
        for i, sid in enumerate(ids):
            old = held.get(sid)
            vector = None if vectors is None else vectors[i]
            if old is None:
                if mode == "update":
                    continue
                writes.append(Record(P.point_id(sid), sid, documents[i], uris[i], _fresh(metadatas[i]),
                                     next(stamps), vector))
            elif mode != "add":
                given_documents = payload.get("documents") is not None
                given_uris = payload.get("uris") is not None
                writes.append(Record(old.pid, sid, documents[i] if given_documents else old.document,
                                     uris[i] if given_uris else old.uri, merged(old.metadata, metadatas[i]),
                                     old.seq, vector if vector is not None else old.vector))
        for record in writes:
            _fits(record)  # a merge may have grown it
        await self._write(writes)

    async def delete(self, payload: dict) -> int:
        ids = _ids(payload, self.limits.max_batch, required=False)
        where, where_document = payload.get("where"), payload.get("where_document")
        if ids is None and not where and not where_document:
            raise invalid("delete needs ids, where or where_document")
        records = await self.selected(ids, where, where_document)
        limit = payload.get("limit")
        if limit is not None:
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise invalid("limit: a non-negative integer")
            records = records[:limit]
        for start in range(0, len(records), self.limits.max_write_points):
            part = records[start:start + self.limits.max_write_points]
            await self.native("POST", "delete", {"ids": [r.pid for r in part]})
        return len(records)

    # --- reads
    async def get(self, payload: dict) -> dict:
        include = _include(payload.get("include"), {"documents", "metadatas"}, query=False)
        limit, offset = payload.get("limit"), payload.get("offset") or 0
        for name, value in (("limit", limit), ("offset", offset)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise invalid(f"{name}: a non-negative integer")
        ids = _ids(payload, self.limits.max_batch, required=False)
        records = await self.selected(ids, payload.get("where"), payload.get("where_document"))
        records = records[offset:] if limit is None else records[offset:offset + limit]
        if len(records) > MAX_ANSWERED:
            raise invalid(f"a get answers at most {MAX_ANSWERED} records: give a limit")
        if include - {"distances"} and records:  # the window's columns (and vectors), read now
            window = {r.pid: r for r in await self._points([r.pid for r in records], "embeddings" in include)}
            records = [window[r.pid] for r in records if r.pid in window]
        return {"ids": [r.sid for r in records], **_fields(records, include), "include": sorted(include)}

    async def count(self) -> int:
        if self.dim is None:
            return 0
        return int((await self.native("POST", "count", {}))["count"])  # type: ignore[index]

    async def query(self, payload: dict) -> dict:
        include = _include(payload.get("include"), {"documents", "metadatas", "distances"}, query=True)
        given_queries = payload.get("query_embeddings")
        if not isinstance(given_queries, list):
            raise invalid("query_embeddings: a list of embeddings")
        queries = embeddings_of(given_queries, len(given_queries), "query_embeddings")
        if not queries:
            raise invalid("query_embeddings: at least one")
        if len(queries) > MAX_QUERIES_PER:
            raise invalid(f"at most {MAX_QUERIES_PER} query_embeddings a request")
        n = payload.get("n_results", 10)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise invalid("n_results: a positive integer")
        ids = _ids(payload, self.limits.max_batch, required=False)
        where, where_document = payload.get("where"), payload.get("where_document")
        empty = {"ids": [[] for _ in queries], **{f: [[] for _ in queries] for f in sorted(include)},
                 "include": sorted(include)}
        if self.dim is None or (ids is not None and not ids):
            return _with_nulls(empty, include)
        matrix = np.asarray(queries, np.float64)
        if matrix.ndim != 2:
            raise invalid("Inconsistent dimensions in provided embeddings")
        self._checked_dim(list(queries))
        allowed: list[Record] | None = None
        if ids is not None or where or where_document:
            allowed = await self.selected(ids, where, where_document)
            if ids is not None and len({r.sid for r in allowed}) < len(ids) and not (where or where_document):
                missing = sorted(set(ids) - {r.sid for r in allowed})
                raise ChromaRefusal(500, "InternalError", f"Error finding id {missing[0][:80]}")
            if not allowed:
                return _with_nulls(empty, include)
        found = await self._nearest(matrix, n, allowed)
        wanted = sorted({pid for row in found for pid in row})
        records = {r.pid: r for r in await self._points(wanted, True)}
        answer: dict = {"ids": []}
        for field in include:
            answer[field] = []
        for q, row in enumerate(found):
            hits = [records[pid] for pid in row if pid in records]
            vectors = np.asarray([r.vector for r in hits])
            distances = _distances(self.metric, matrix[q:q + 1], vectors)[0].tolist() if hits else []
            order = sorted(range(len(hits)), key=lambda i: distances[i])
            hits, distances = [hits[i] for i in order], [distances[i] for i in order]
            answer["ids"].append([r.sid for r in hits])
            for field, values in _fields(hits, include - {"distances"}).items():
                answer[field].append(values)
            if "distances" in include:
                answer["distances"].append(distances)
        answer["include"] = sorted(include)
        return _with_nulls(answer, include)

    async def _points(self, pids: list[int], vectors: bool) -> list[Record]:
        records: list[Record] = []
        for start in range(0, len(pids), self.limits.max_page):
            answer = await self.native("POST", "points", {"ids": pids[start:start + self.limits.max_page],
                                                          "vectors": vectors})
            records.extend(self._record(point) for point in answer["points"])  # type: ignore[index]
        return records

    async def _nearest(self, matrix: np.ndarray, n: int, allowed: list[Record] | None) -> list[list[int]]:
        """Per query, the ids of its n nearest among `allowed` (None: all), by the native search (in
        parts of ID_PART ids, merged), or scored here when n is past the native max_k; max_vectors
        queries at a time."""
        step = self.limits.max_vectors
        if len(matrix) > step:
            rows: list[list[int]] = []
            for start in range(0, len(matrix), step):
                rows.extend(await self._nearest(matrix[start:start + step], n, allowed))
            return rows
        if n > self.limits.max_k:
            return await self._brute(matrix, n, allowed)
        if self.search is not None:  # in-process: every allowed id at once, as an array
            among = None if allowed is None else allowed.among if isinstance(allowed, Passing) else Among.of(
                np.fromiter((r.pid for r in allowed), np.int64, len(allowed)))
            answered = await self.search(matrix.astype(np.float32), n, among)
            if answered is not None:
                return [[int(pid) for pid in row if pid >= 0] for row in answered[1]]
        parts: list[list[int] | None] = [None] if allowed is None else [
            [r.pid for r in allowed[s:s + ID_PART]] for s in range(0, len(allowed), ID_PART)]
        distances, ids = [], []
        for part in parts:
            body: dict = {"vectors": matrix.astype(np.float32).tolist(), "k": n}
            if part is not None:
                body["filter"] = {"$id": {"$in": part}}
            answer = await self.native("POST", "search", body)
            d = np.full((len(matrix), n), np.inf, np.float32)
            i = np.full((len(matrix), n), -1, np.int64)
            for q, result in enumerate(answer["results"]):  # type: ignore[index]
                found = len(result["ids"])
                d[q, :found], i[q, :found] = result["distances"], result["ids"]
                if self.metric != "l2":
                    d[q, found:] = -np.inf
            distances.append(d)
            ids.append(i)
        _, best = merge_topk(distances, ids, n, higher_is_better=self.metric != "l2")
        return [[int(pid) for pid in row if pid >= 0] for row in best]

    async def _brute(self, matrix: np.ndarray, n: int, allowed: list[Record] | None) -> list[list[int]]:
        """Scored here, in a thread, vectorised: at most MAX_BRUTE records x max_vectors queries."""
        pids = [r.pid for r in (allowed if allowed is not None else await self.scanned(["sid", "seq"]))]
        if len(pids) > MAX_BRUTE:
            raise invalid(f"n_results {n} is past {self.limits.max_k} (max_k) over more than {MAX_BRUTE} "
                          "records")
        records = await self._points(pids, True)
        if not records:
            return [[] for _ in matrix]

        def scored() -> np.ndarray:
            vectors = np.asarray([r.vector for r in records])
            # BRUTE_QUERIES at a time: a (queries x records) float64 matrix of at most 10 MB
            return np.concatenate([np.argsort(_distances(self.metric, matrix[s:s + BRUTE_QUERIES], vectors),
                                              axis=1, kind="stable")[:, :n]
                                   for s in range(0, len(matrix), BRUTE_QUERIES)])

        order = await asyncio.to_thread(scored)
        return [[records[j].pid for j in row] for row in order]


def _distances(metric: str, queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Chroma's distances (hnswlib's: squared L2, 1 - dot, 1 - cosine with its epsilon) of each
    query to each vector, in float64 on the float32 values, as (queries, vectors)."""
    q = np.asarray(queries, np.float32).astype(np.float64)
    v = np.asarray(vectors, np.float32).astype(np.float64)
    if metric == "l2":
        if len(q) * len(v) * q.shape[1] <= DIRECT_L2:  # the k found: (q - v)^2, exactly as Chroma's reference
            return ((q[:, None, :] - v[None, :, :]) ** 2).sum(axis=2)
        # many (ranking past max_k): |q|^2 + |v|^2 - 2 q.v, without a (queries x vectors x dim) array
        return np.maximum((q * q).sum(axis=1)[:, None] + (v * v).sum(axis=1)[None, :] - 2.0 * (q @ v.T), 0.0)
    dots = q @ v.T
    if metric == "ip":
        return 1.0 - dots
    return 1.0 - dots / (np.linalg.norm(q, axis=1)[:, None] * np.linalg.norm(v, axis=1)[None, :] + 1e-30)


class Passing(list):
    """The records that passed a filter, in insertion order, with the ids a query searches among,
    made once with them (the ScanCache keeps a filter's answer for the queries that follow)."""

    among: Among


def _passing(records: list[Record], where: dict | None, where_document: dict | None) -> Passing:
    found = Passing(r for r in records if matches(where, r.metadata, r.document)
                    and _document_matches(where_document, r.document))
    found.among = Among.of(np.fromiter((r.pid for r in found), np.int64, len(found)))
    return found


def _document_matches(where_document: dict | None, document: str | None) -> bool:
    from shardserve.chroma.where import matches_document

    return matches_document(where_document, document)


def _include(value: object, default: set[str], query: bool) -> set[str]:
    if value is None:
        return set(default)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid("include: a list of names")
    unknown = set(value) - INCLUDABLE - {"data"}
    if unknown:
        raise invalid(f"include: {sorted(unknown)[0][:40]!r} is not one of {sorted(INCLUDABLE)}")
    if "distances" in value and not query:
        raise invalid("include: distances only with a query")
    return set(value) - {"data"}


def _fields(records: list[Record], include: set[str]) -> dict:
    out: dict = {}
    if "embeddings" in include:
        out["embeddings"] = [r.vector for r in records]
    if "documents" in include:
        out["documents"] = [r.document for r in records]
    if "metadatas" in include:
        out["metadatas"] = [r.metadata for r in records]
    if "uris" in include:
        out["uris"] = [r.uri for r in records]
    return out


def _with_nulls(answer: dict, include: set[str]) -> dict:
    for field in ("embeddings", "documents", "metadatas", "distances", "uris"):
        if field not in include:
            answer[field] = None
    return answer


def _collision(sid: str, held: str) -> ChromaRefusal:
    return ChromaRefusal(409, "ChromaError", f"id {sid[:80]!r} hashes to the record of id {held[:80]!r} in "
                                             "this collection: use another id")


def dumps(payload: object) -> bytes:
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
