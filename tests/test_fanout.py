"""Fan-out + merge with in-process shard searchers (no Ray): grouping, deadlines, coverage."""

from __future__ import annotations

import asyncio

import pytest

from serving.evaluate import sharded_search
from shardserve.query.api import ParsedQuery
from shardserve.query.fanout import hedged, search_batch, search_grouped
from shardserve.transport.shard_wire import ShardQuery
from tests.shared import shards


def _caller(searchers, slow: set[int] = frozenset(), delay: float = 0.0):
    async def call(shard: int, query: ShardQuery):
        if shard in slow:
            await asyncio.sleep(delay)
        return searchers[shard].answer(query)
    return call


def test_mixed_groups_get_their_own_answers() -> None:
    data, searchers = shards()
    queries = [ParsedQuery(matrix=data.queries[i:i + 1], k=k, params=(("nprobe", p),), single=True,
                           require_full=False)
               for i, (k, p) in enumerate([(3, 1), (10, 16), (3, 1), (5, 4)])]
    seen: list[tuple[int, float | None]] = []
    results = asyncio.run(search_batch(queries, _caller(searchers), 3, False, 5.0,
                                       lambda s, ms: seen.append((s, ms))))
    for query, result in zip(queries, results, strict=True):
        _, expected = sharded_search(searchers, query.matrix, query.k, dict(query.params), "l2")
        assert result.ids.tolist() == expected.tolist() and result.answered == 3
    assert results[0].batch_size == 2  # the two (k=3, nprobe=1) requests shared one scan
    assert len(seen) == 3 * 3 and all(ms is not None for _, ms in seen)


def test_late_shard_is_left_out_and_counted() -> None:
    data, searchers = shards()
    query = ParsedQuery(matrix=data.queries[:2], k=5, params=(), single=False, require_full=False)
    seen: list[tuple[int, float | None]] = []
    (result,) = asyncio.run(search_batch([query], _caller(searchers, {1}, 0.5), 3, False, 0.1,
                                         lambda s, ms: seen.append((s, ms))))
    assert result.answered == 2 and result.shards == 3
    assert (1, None) in seen
    _, expected = sharded_search([searchers[0], searchers[2]], query.matrix, 5, {}, "l2")
    assert result.ids.tolist() == expected.tolist()


def test_all_shards_failing_is_no_answer_not_an_exception() -> None:
    data, searchers = shards()

    async def broken(shard: int, query: ShardQuery):
        raise RuntimeError(f"shard {shard} lost")

    (result,) = asyncio.run(search_batch([ParsedQuery(matrix=data.queries[:1], k=5, params=(), single=True,
                                                          require_full=False)], broken,
                                         3, False, 1.0))
    assert result.answered == 0 and "lost" in result.error  # the router turns this into a 503


def test_batch_of_two_versions_is_answered_per_version_in_order() -> None:
    """Mid-swap a batch holds requests of the old and the new index version: each version searches
    its own requests once, and every answer goes back to the position it came from."""
    old, new = object(), object()
    calls: list[tuple[object, list[str]]] = []

    async def search(version: object, queries: list[str]) -> list[str]:
        calls.append((version, queries))
        return [f"{'old' if version is old else 'new'}:{q}" for q in queries]

    items = [(old, "a"), (new, "b"), (old, "c"), (new, "d")]
    answers = asyncio.run(search_grouped(items, search))
    assert answers == ["old:a", "new:b", "old:c", "new:d"]
    assert sorted(len(q) for _, q in calls) == [2, 2]
    assert asyncio.run(search_grouped([(old, "x")], search)) == ["old:x"]


def test_hedged_call_takes_the_first_answer_and_cancels_the_other() -> None:
    attempts: list[int] = []
    cancelled: list[int] = []

    async def call(shard: int, query: ShardQuery):
        attempt = len(attempts)
        attempts.append(attempt)
        try:
            await asyncio.sleep(1.0 if attempt == 0 else 0.01)  # the first call is the slow one
        except asyncio.CancelledError:
            cancelled.append(attempt)
            raise
        return attempt

    hedges: list[bool] = []
    result = asyncio.run(hedged(call, 0.05, lambda: hedges.append(True))(0, None))
    assert (result, attempts, cancelled, hedges) == (1, [0, 1], [0], [True])


def test_hedged_call_is_not_sent_twice_when_answered_in_time_and_fails_only_if_both_fail() -> None:
    sent: list[int] = []

    async def fast(shard: int, query: ShardQuery):
        sent.append(shard)
        return "ok"

    assert asyncio.run(hedged(fast, 0.5)(3, None)) == "ok" and sent == [3]

    async def broken(shard: int, query: ShardQuery):
        await asyncio.sleep(0.1)
        raise ConnectionError("replica gone")

    with pytest.raises(ConnectionError):
        asyncio.run(hedged(broken, 0.01)(0, None))
