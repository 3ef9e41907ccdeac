"""One error family: every public error derives from ShardserveError, and the client and the server
agree on ApiError (one class, one argument order, the same fields through the wire); product code
raises no bare builtin exception."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import orjson
import pytest

import shardserve
from shardserve import client
from shardserve.errors import ApiError, BadArgument, ServingError, ShardserveError, WireError, WriteLogError
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


ROOT = Path(__file__).resolve().parent.parent
PRODUCT_PACKAGES = ("shardserve", "index_build", "deployments", "serving")
BUILTIN_ERRORS = {"ValueError", "RuntimeError", "TypeError", "Exception", "KeyError"}


@pytest.mark.parametrize(("error", "builtin"), [(BadArgument, ValueError), (WireError, ValueError),
                                                (WriteLogError, RuntimeError), (ServingError, RuntimeError)])
def test_each_family_error_is_also_the_builtin_it_replaced(error: type, builtin: type) -> None:
    """A caller's `except ValueError` / `except RuntimeError` (its own, Ray's, pydantic's) still holds."""
    assert issubclass(error, ShardserveError) and issubclass(error, builtin)


def _builtin_raises(source: str, name: str) -> list[int]:
    """Lines of `raise ValueError(...)` and the like (a bare `raise`, or a family error, passes)."""
    lines = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id in BUILTIN_ERRORS:
                lines.append(node.lineno)
    return sorted(lines)


def test_product_code_raises_only_family_errors() -> None:
    found = {str(path.relative_to(ROOT)): lines for package in PRODUCT_PACKAGES
             for path in sorted((ROOT / package).rglob("*.py"))
             if (lines := _builtin_raises(path.read_text(), str(path)))}
    offenders = [f"{path}:{line}" for path, lines in found.items() for line in lines]
    assert offenders == [], "raise a shardserve.errors class (it can derive from the builtin too)"


def test_the_raise_check_sees_a_builtin_raise() -> None:
    """The test above would pass vacuously if the parser missed raises: show what it sees."""
    source = ("def f(x):\n"
              "    try:\n"
              "        if x:\n"
              "            raise ValueError('no')\n"
              "        raise RuntimeError\n"
              "    except KeyError as exc:\n"
              "        raise BadArgument('bad') from exc\n"
              "    except TypeError:\n"
              "        raise\n")
    assert _builtin_raises(source, "probe.py") == [4, 5]
