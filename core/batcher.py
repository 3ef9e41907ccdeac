"""Adaptive batching: whenever a batch slot is free, take EVERYTHING queued as one batch.

Why not `@serve.batch`: it forms a batch when requests arrive (waiting at most batch_wait_timeout_s)
and only then waits for a free slot, so under steady open-loop arrivals its batches stay at 1-2
requests however long the queue grows (measured on 2 cores: 4-shard throughput stuck at ~230 req/s
open-loop vs ~650 closed-loop). Here the batch is formed when a slot frees, so batch size follows the
queue: one request at low load (no added latency), everything in flight under a burst.

A batch beyond the first starts only when it is worth running beside it: when what is queued holds
at least `overlap_min_size` vectors, or when the oldest queued request has waited `overlap_after_s`
(the running batch is slow: a straggling shard, a large scan). Small batches run one after another
otherwise: on a 2-core node, two small batches in flight cost 1.18x the CPU per query of one at a
time for 0.87x the throughput, at the same mean batch size (loadtests/records/batches-ab.json). The
wait keeps a slow shard's queue visible to its autoscaler (deployments.autoscaling).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class AdaptiveBatcher(Generic[Item, Result]):
    """Runs `handler(batch) -> results` with at most `max_concurrent` batches in flight."""

    def __init__(self, handler: Callable[[list[Item]], Awaitable[list[Result]]], max_batch_size: int,
                 max_concurrent: int, size_of: Callable[[Item], int] = lambda _: 1,
                 overlap_min_size: int = 1, overlap_after_s: float = 0.0):
        if max_batch_size < 1 or max_concurrent < 1 or overlap_min_size < 1 or overlap_after_s < 0:
            raise ValueError("max_batch_size, max_concurrent and overlap_min_size must be >= 1, "
                             "overlap_after_s >= 0")
        self.handler = handler
        self.max_batch_size = max_batch_size
        self.max_concurrent = max_concurrent
        self.size_of = size_of
        self.overlap_min_size, self.overlap_after_s = overlap_min_size, overlap_after_s
        self.running = 0
        self._queue: deque[tuple[Item, asyncio.Future]] = deque()
        self._queued_size = 0
        self._overlap_timer: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, item: Item) -> Result:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        self._queued_size += self.size_of(item)
        self._start_batches()
        return await future

    def _start_batches(self, overlap_due: bool = False) -> None:
        while self.running < self.max_concurrent and self._queue:
            if self.running and not overlap_due and self._queued_size < self.overlap_min_size:
                self._arm_overlap_timer()  # small: it waits for the running batch, or the timer
                return
            overlap_due = False  # the timer lets one batch through
            batch = [self._queue.popleft()]
            size = self.size_of(batch[0][0])
            while self._queue and size + self.size_of(self._queue[0][0]) <= self.max_batch_size:
                size += self.size_of(self._queue[0][0])
                batch.append(self._queue.popleft())
            self._queued_size -= size
            live = [(item, future) for item, future in batch if not future.done()]  # drop cancelled
            if not live:
                continue
            self.running += 1
            asyncio.get_running_loop().create_task(self._run(live))
        if not self._queue and self._overlap_timer is not None:
            self._overlap_timer.cancel()
            self._overlap_timer = None

    def _arm_overlap_timer(self) -> None:
        if self._overlap_timer is None:
            self._overlap_timer = asyncio.get_running_loop().call_later(self.overlap_after_s,
                                                                        self._overlap_due)

    def _overlap_due(self) -> None:
        self._overlap_timer = None
        self._start_batches(overlap_due=True)

    async def _run(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        try:
            results = await self.handler([item for item, _ in batch])
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
        except Exception as exc:  # every request of the batch gets the error
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
        finally:
            self.running -= 1
            self._start_batches()
