"""One error family: every public error derives from ShardserveError, and the client and the server
agree on ApiError (one class, one argument order, the same fields through the wire)."""

from __future__ import annotations

import httpx
import orjson
import pytest

import shardserve
from shardserve import client
from shardserve.errors import ApiError, ShardserveError
from shardserve.query import api
from shardserve.transport.shard_link import ShardLinkError


def test_every_public_error_derives_from_one_base() -> None:
    for error in (shardserve.ApiError, api.ApiError, client.ApiError, ShardLinkError):
        assert issubclass(error, ShardserveError)
    assert issubclass(ShardLinkError, RuntimeError)


def test_the_client_and_the_server_share_one_api_error() -> None:
    assert shardserve.ApiError is api.ApiError is client.ApiError is ApiError


@pytest.mark.parametrize("field", ["vector", "params.nprobe", None])
def test_the_client_reads_back_the_fields_the_server_sent(field: str | None) -> None:
    """The server's refusal, rendered as the router renders it, raised again by the client."""
    sent = ApiError(503, field, "only 3 of 4 shards answered", retry_after=2.0)
    answer = httpx.Response(sent.status, content=sent.body(),
                            headers={"Retry-After": str(int(sent.retry_after or 0))})
    with pytest.raises(ApiError) as raised:
        client._answer(answer)
    got = raised.value
    assert (got.status, got.field, got.message, got.retry_after) == (503, field, sent.message, 2.0)
    assert str(got) == str(sent)
    assert orjson.loads(got.body()) == {"error": sent.message, "field": field}
