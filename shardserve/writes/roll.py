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


def roll_forward(found: Sequence[Found], requests: Sequence[tuple[int, list[Op]]], where: str,
                 schema: pa.Schema) -> np.ndarray:
    """The ids that match `where` once each shard's `found` ids are carried through the `requests`
    (the log's, in order) past the position it found them at: a delete drops its id, an upsert
    keeps or adds its id as its new metadata pass the filter. Sorted, distinct."""
    passed = {position: passing(where, [op for op in ops if isinstance(op, Upsert)], schema)
              for position, ops in requests}
    live: set[int] = set()
    for ids, at in found:
        mine = set(np.asarray(ids, np.int64).tolist())
        for position, ops in requests:
            if position <= at:
                continue
            for op in ops:
                if isinstance(op, Upsert) and op.id in passed[position]:
                    mine.add(op.id)
                else:
                    mine.discard(op.id)
        live |= mine
    return np.array(sorted(live), np.int64)
