"""A delete by filter's matches carried forward through the writes that landed after the shards found
them, so that the delete takes effect exactly on the state the log is in when it is appended.

Why: every shard finds its live matching ids at some log position, and the delete is appended
later, after whatever other routers (and this one) appended meanwhile. Appending the ids as found
would delete a point that an upsert in between made stop matching, and miss one that an upsert in
between made match. Requiring the log not to move between the evaluation and the append (the first
design) is exact too, but under a steady ingest it never succeeds: beside 200 single upserts/s, 60
deletes by filter of 60 got a 503 after three evaluations each. Carrying the matches forward needs
only the requests in between (read from the log, usually a handful), whose upserts' metadata the
filter is evaluated on here (shardserve.query.filters, the shards' own evaluator), so it succeeds
whatever the ingest; the append stays conditional on the log not moving past what was read, which
only the short read-then-append window can miss, and a miss just reads the new requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from shardserve.query.filters import matching
from shardserve.writes.ops import Op, Upsert

Found = tuple[np.ndarray, int]  # one shard's live matching ids, and the log position it found them at


def gathered(answers: Sequence[tuple[np.ndarray, int, int, pa.Schema | None]],
             limit: int) -> tuple[list[Found], int, pa.Schema | None]:
    """The shards' answers to a delete by filter (each: its matching ids, or none past `limit`; how
    many; its log position; its metadata schema) → (each shard's Found; how many in all; the
    schema). Over `limit` in all: no ids. Summed, an id that moved between shards while they
    looked is in two lists: when every shard sent its ids, it counts once (the carry-forward
    has the last word), so a filter within the limit is not refused for it."""
    count = sum(n for _, n, _, _ in answers)
    schema = next((held for _, _, _, held in answers if held is not None), None)
    if count > limit and all(len(ids) == n for ids, n, _, _ in answers):
        count = len(np.unique(np.concatenate([np.asarray(ids, np.int64) for ids, _, _, _ in answers])))
    if count > limit:
        return [], count, schema
    return [(np.asarray(ids, np.int64), int(position)) for ids, _, position, _ in answers], count, schema


def metadata_schema(kinds: dict[str, str]) -> pa.Schema:
    """An arrow schema for metadata of these column kinds (GET /v1/index's `metadata_kinds`): what
    the router uses when the shards did not send theirs. The shards' own is what to evaluate with:
    a "number" column may be float32 there, and 0.1 as float32 is not 0.1."""
    types = {"bool": pa.bool_(), "string": pa.string(), "number": pa.float64()}
    return pa.schema([(name, types.get(kind) or pa.type_for_alias(kind)) for name, kind in kinds.items()])


def passing(where: str, upserts: Sequence[Upsert], schema: pa.Schema) -> set[int]:
    """The ids of `upserts` whose new metadata pass the checked filter `where` (no metadata: every
    column null, as the shards hold it)."""
    if not upserts:
        return set()
    columns = {field.name: pa.array([None if op.metadata is None else op.metadata.get(field.name)
                                     for op in upserts], field.type) for field in schema}
    ids = np.array([op.id for op in upserts], np.int64)
    return set(matching(where, pa.table(columns, schema=schema), ids).tolist())


class Carried:
    """The shards' `found` ids carried through the log's requests past the earliest position a shard
    found them at, a few requests at a time (`through`, in log order): a delete drops its id, an
    upsert keeps or adds its id as its new metadata pass the filter `where`. What is held is one
    set of ids and the position reached, never the requests: a delete by filter appended behind a
    long queue reads the requests in between as the replicas do, 32 at a time, and a conditional
    append that missed goes on from where it stopped instead of reading again.

    Why one set, whatever position each shard looked at: an id's state in the log's newest request
    is its last operation's. Where that operation is read here (past the earliest shard's
    position), applying the requests in order ends with it, whatever was found. Where it is not,
    nothing changed the id since every shard looked: it matches if and only if the shard holding it
    found it. A request a shard had already applied (at or before its position) is applied again
    here; a later one overrides it in the same way, so it changes nothing (the model test,
    tests/test_parse_writes.py, checks this against the true state over random logs)."""

    def __init__(self, found: Sequence[Found], where: str, schema: pa.Schema):
        self.where, self.schema = where, schema
        self._live: set[int] = set().union(*(np.asarray(ids, np.int64).tolist() for ids, _ in found))
        self.position = min((at for _, at in found), default=0)  # carried up to this request

    def through(self, requests: Sequence[tuple[int, list[Op]]]) -> Carried:
        """Carry the set through `requests`, the log's next ones after `position`, in order."""
        for position, ops in requests:
            if position <= self.position:  # carried already: applying it again would undo later ones
                continue
            passed = passing(self.where, [op for op in ops if isinstance(op, Upsert)], self.schema)
            for op in ops:
                if isinstance(op, Upsert) and op.id in passed:
                    self._live.add(op.id)
                else:
                    self._live.discard(op.id)
            self.position = position
        return self

    def ids(self) -> np.ndarray:
        """The ids that match once carried: sorted, distinct."""
        return np.array(sorted(self._live), np.int64)
