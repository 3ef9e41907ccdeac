"""Fan a batch of queries out to every shard and merge: the router's core, plain asyncio + numpy.

One call per shard per (k, params) group of the batch, the same encoded query bytes to every shard;
the shard that misses the deadline is left out and counted in coverage. Testable with in-process
searchers, no Ray needed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np

from shardserve.query.api import ParsedQuery
from shardserve.query.merge import QueryResult, merge_topk
from shardserve.tracing import Span, Traced, end, now, traceparent
from shardserve.transport.shard_wire import ShardQuery

# (shard index, the group's query) -> (distances, ids, search ms[, rows a filter matched[, position]])
# a shard call answers (distances, ids, search ms), with a filter also the rows it matched, and over
# a write log the log position its answer is the state at (decode_answer's five fields)
ShardCall = Callable[[int, ShardQuery], Awaitable[tuple]]
# (prepared matrix, k, params) -> the query every shard gets (e.g. with IVF lists assigned once)
Prepare = Callable[[np.ndarray, int, dict], Awaitable[ShardQuery]]


Group = TypeVar("Group")
Query = TypeVar("Query")
Answer = TypeVar("Answer")


async def plain_query(matrix: np.ndarray, k: int, params: dict) -> ShardQuery:
    """No router-side work: each shard searches its whole index (non-IVF indexes)."""
    return ShardQuery(matrix, k, params)


async def search_batch(queries: list[ParsedQuery], call_shard: ShardCall, num_shards: int,
                       higher_is_better: bool, timeout_s: float,
                       on_shard_done: Callable[[int, float | None], None] | None = None,
                       prepare: Prepare = plain_query,
                       on_matched: Callable[[str, list[int | None]], None] | None = None,
                       ) -> list[QueryResult]:
    """Answer every query of the batch, grouping those that can share one scan per shard.
    `on_matched(filter, rows)`: after a filtered group, the rows each shard matched (None: no answer)."""
    groups: dict[tuple, list[int]] = {}
    for position, query in enumerate(queries):
        groups.setdefault(query.group_key, []).append(position)
    results: list[QueryResult | None] = [None] * len(queries)
    if len(groups) == 1:  # the steady state: no extra task per batch
        await _search_group(queries, list(range(len(queries))), results, call_shard, num_shards,
                            higher_is_better, timeout_s, on_shard_done, prepare, on_matched)
        return results  # type: ignore[return-value]
    await asyncio.gather(*[
        _search_group([queries[p] for p in positions], positions, results, call_shard, num_shards,
                      higher_is_better, timeout_s, on_shard_done, prepare, on_matched)
        for positions in groups.values()])
    return results  # type: ignore[return-value]


async def _search_group(group: list[ParsedQuery], positions: list[int], results: list,
                        call_shard: ShardCall, num_shards: int, higher_is_better: bool,
                        timeout_s: float, on_shard_done, prepare: Prepare, on_matched) -> None:
    k, params = group[0].k, dict[str, object](group[0].params)
    if group[0].filter is not None:  # the shards evaluate it on their own metadata
        params["filter"] = group[0].filter
    matrix = group[0].matrix if len(group) == 1 else np.concatenate([q.matrix for q in group])
    traced = [q.trace for q in group if q.trace is not None]
    fan = _fan_out_span(traced, num_shards, len(matrix)) if traced else None
    started = time.perf_counter()
    shard_query = await prepare(matrix, k, params)
    prepare_ms = (time.perf_counter() - started) * 1000.0
    if fan is not None:  # every shard's span is a child of the fan-out's
        shard_query.trace = traceparent(fan)
    outcomes = await _call_every_shard(call_shard, shard_query, num_shards, timeout_s)
    fanout_ms = (time.perf_counter() - started) * 1000.0
    answered = [o for o in outcomes if not isinstance(o, BaseException)]
    if fan is not None:
        end(fan, prepare_ms=round(prepare_ms, 3), **{"shards.answered": len(answered)})
        merging = now()
    if on_shard_done is not None:
        for shard, outcome in enumerate(outcomes):
            on_shard_done(shard, None if isinstance(outcome, BaseException) else outcome[2])
    error = None
    if answered:
        distances, ids = merge_topk([o[0] for o in answered], [o[1] for o in answered], k,
                                    higher_is_better, positions=[o[4] if len(o) > 4 else 0 for o in answered])
    else:
        fill = -np.inf if higher_is_better else np.inf
        distances = np.full((len(matrix), k), fill, np.float32)
        ids = np.full((len(matrix), k), -1, np.int64)
        first = next((o for o in outcomes if isinstance(o, BaseException)), None)
        error = f"{type(first).__name__}: {first}"[:500] if first is not None else None
    if fan is not None:
        traced[0].tracer.child(traced[0].span, "merge", merging, now())
    compute_ms = prepare_ms + max((o[2] for o in answered), default=0.0)
    matched = sum(o[3] for o in answered if len(o) > 3)  # rows the filter let through, all shards
    if on_matched is not None and group[0].filter is not None:
        on_matched(group[0].filter, [None if isinstance(o, BaseException) or len(o) < 4 else int(o[3])
                                     for o in outcomes])
    row = 0
    for query, position in zip(group, positions, strict=True):
        rows = slice(row, row + len(query.matrix))
        row += len(query.matrix)
        results[position] = QueryResult(distances[rows], ids[rows], len(answered), num_shards,
                                        compute_ms, fanout_ms, len(matrix), error, matched)


def _fan_out_span(traced: list[Traced], num_shards: int, rows: int) -> Span:
    """The span of one group's calls to every shard, in the first traced request's trace (a batch
    is one piece of work however many requests share it), linked to the other traced requests'."""
    first = traced[0]
    return first.tracer.child(first.span, "fan-out", links=[t.span for t in traced[1:]],
                              attributes={"shards": num_shards, "rows": rows, "requests.traced": len(traced)})


async def _call_every_shard(call_shard: ShardCall, query: ShardQuery, num_shards: int,
                            timeout_s: float) -> list:
    """Every shard's answer or exception, under one deadline for the whole fan-out (one timer, not a
    `wait_for` wrapper per call); calls still running at the deadline are cancelled."""
    tasks = [asyncio.ensure_future(call_shard(shard, query)) for shard in range(num_shards)]
    try:
        await asyncio.wait(tasks, timeout=timeout_s)
    finally:  # also when the batch itself is cancelled
        for task in tasks:
            if not task.done():
                task.cancel()
    return [task.exception() or task.result() if task.done() and not task.cancelled()
            else TimeoutError(f"no answer within {timeout_s:g} s") for task in tasks]


async def search_grouped(items: list[tuple[Group, Query]],
                         search: Callable[[Group, list[Query]], Awaitable[list[Answer]]]) -> list[Answer]:
    """Answer a batch whose items belong to different groups (index versions, told apart by
    identity: two only in the instant of a swap): one `search` per group, answers in item order."""
    first = items[0][0]
    if all(group is first for group, _ in items):  # the steady state: one group, no extra task
        return await search(first, [query for _, query in items])
    positions: dict[int, list[int]] = {}
    for position, (group, _) in enumerate(items):
        positions.setdefault(id(group), []).append(position)
    groups = list(positions.values())
    answers = await asyncio.gather(*[search(items[g[0]][0], [items[p][1] for p in g]) for g in groups])
    ordered: list = [None] * len(items)
    for group_positions, group_answers in zip(groups, answers, strict=True):
        for position, answer in zip(group_positions, group_answers, strict=True):
            ordered[position] = answer
    return ordered


def hedged(call: ShardCall, after_s: float, on_hedge: Callable[[], None] | None = None) -> ShardCall:
    """`call`, sent again if not answered after `after_s` (to another replica, when the transport
    picks one by load); the first answer wins and the other call is cancelled. Fails only if both do."""

    async def call_hedged(shard: int, query: ShardQuery):
        tasks = [asyncio.ensure_future(call(shard, query))]
        try:
            done, _ = await asyncio.wait(tasks, timeout=after_s)
            if not done:
                if on_hedge is not None:
                    on_hedge()
                tasks.append(asyncio.ensure_future(call(shard, query)))
            failure: BaseException | None = None
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        return task.result()
                    failure = task.exception()
            raise failure  # type: ignore[misc]  # every call failed
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()  # a Serve call cancels its request; a link call forgets its answer

    return call_hedged
