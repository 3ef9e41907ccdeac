"""The one error family: every error shardserve raises on purpose derives from `ShardserveError`.

`ApiError` is the HTTP API's refusal, the same class on both sides: the server raises it with the
status, the field at fault and a message (shardserve.query.api), and the client raises it again from
the answer it got (shardserve.client). `ShardLinkError` is a shard's error carried back over its link
(shardserve.transport.shard_link). The CLI prints any of them on one line and exits non-zero.

Where shardserve once raised a builtin, its error now derives from that builtin too (`BadArgument` and
`WireError` are ValueErrors, `WriteLogError` and `ServingError` RuntimeErrors), so a caller's
`except ValueError` or `except RuntimeError` (Ray's, pydantic's, or its own) catches it as before.
"""

from __future__ import annotations

import orjson


class ShardserveError(Exception):
    """The base of the family. Raised itself, a problem the user can fix (bad input, missing data,
    corrupt index); never a bug."""


class ApiError(ShardserveError):
    """A refused request: HTTP `status`, the request `field` at fault (or None), a `message` that says
    how to fix it, and `retry_after` seconds on 503."""

    def __init__(self, status: int, field: str | None, message: str, retry_after: float | None = None):
        super().__init__(f"HTTP {status}: {message}" + (f" (field {field})" if field else ""))
        self.status, self.field, self.message, self.retry_after = status, field, message, retry_after

    def body(self) -> bytes:
        """The JSON the server answers with, and the client reads back."""
        return orjson.dumps({"error": self.message, "field": self.field})


class BadArgument(ShardserveError, ValueError):
    """A value given to a shardserve API, constructor or config is out of range or inconsistent with
    the others (a client call with both or neither of two inputs, a batcher, admission or autoscaling
    setting below its minimum, a layouts record that cannot be fitted), or a request asks of an index
    what it cannot do (a filter on a shard without metadata, list assignments for a non-IVF index)."""


class WireError(ShardserveError, ValueError):
    """Bytes from the network that do not parse as a shard frame (shardserve.transport.shard_wire): a
    query or an answer with the wrong magic, a header that disagrees with the shard's bounds or with
    the frame's length, params that are not the JSON object expected."""


class WriteLogError(ShardserveError, RuntimeError):
    """The write log cannot do what was asked: its storage (SQLite, Redis) is not what the log needs
    (an old SQLite, no WAL mode or fsync, a Redis without appendfsync or with eviction), it holds what
    it must not (a newer schema, a request missing operations), or it was opened read-only."""


class ServingError(ShardserveError, RuntimeError):
    """A running part of a deployment is in a state, or gave an answer, the caller cannot use: a shard
    replica lost its index, not every shard of an index version answered, the embedder answered
    vectors of the wrong shape."""
