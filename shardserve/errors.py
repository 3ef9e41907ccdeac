"""The one error family: every error shardserve raises on purpose derives from `ShardserveError`.

`ApiError` is the HTTP API's refusal, the same class on both sides: the server raises it with the
status, the field at fault and a message (shardserve.query.api), and the client raises it again from
the answer it got (shardserve.client). `ShardLinkError` is a shard's error carried back over its link
(shardserve.transport.shard_link). The CLI prints any of them on one line and exits non-zero.
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
