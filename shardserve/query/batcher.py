"""Adaptive batching: whenever a batch slot is free, take EVERYTHING queued as one batch.

Why not `@serve.batch`: it forms a batch when requests arrive (waiting at most batch_wait_timeout_s)
and only then waits for a free slot, so under steady open-loop arrivals its batches stay at 1-2
requests however long the queue grows, and open-loop throughput stays far below closed-loop
(docs/experiments.md, the `@serve.batch` row). Here the batch is formed when a slot frees, so batch
size follows the queue: one request at low load (no added latency), everything in flight under a burst.

Beyond `at_once` batches in flight, a batch starts only for large work (at least `overlap_min_size`
vectors queued): a shard replica scans one batch at a time, so a second small batch only overlaps
the router's parsing and merging with a scan, and costs more than it gains (smaller batches, more
of them), while two 256-vector requests gain from overlapping one's quantizing and merging with the
other's scan.

Filling (`fill`, a fraction of a batch's time): when a batch ends, the clients it answered are about
to send their next requests. Starting the next batch at once with what is queued splits the clients
into groups that alternate (16 and 16 of 32, each batch half as large as the clients), and where a
shard's scan is shared by a batch's queries (query.scan_choice) half-size batches share half as
much. So when a batch ends, the next one waits until the queue holds what was queued plus the
batch just answered (FILL_SHARE of it: all of it), or for `fill` x that batch's time (at most
`fill_max_s`), whichever comes first. After a batch of one request nothing waits (one client at a
time is never delayed), nor while another batch is in flight; a queue that already holds a full
batch's worth never waits. Waiting for only most of them would leave the last clients to come
back waiting a whole batch more, a tail of their own; waiting for all of them, with the timer
bounding the wait, does not (docs/experiments.md has the A/Bs).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from shardserve.errors import BadArgument

FILL_SHARE = 1.0  # of the batch just answered: the share of its vectors a new batch waits for

Item = TypeVar("Item")
Result = TypeVar("Result")


class AdaptiveBatcher(Generic[Item, Result]):
    """Runs `handler(batch) -> results` with at most `max_concurrent` batches in flight."""

    def __init__(self, handler: Callable[[list[Item]], Awaitable[list[Result]]], max_batch_size: int,
                 max_concurrent: int, size_of: Callable[[Item], int] = lambda _: 1,
                 at_once: int | None = None, overlap_min_size: int = 1, fill: float = 0.0,
                 fill_max_s: float = 0.005):
        if max_batch_size < 1 or max_concurrent < 1 or overlap_min_size < 1:
            raise BadArgument("max_batch_size, max_concurrent and overlap_min_size must be >= 1")
        if not 0.0 <= fill <= 1.0 or fill_max_s < 0.0:
            raise BadArgument("fill must be in [0, 1] and fill_max_s >= 0")
        self.handler = handler
        self.max_batch_size = max_batch_size
        self.max_concurrent = max_concurrent
        self.size_of = size_of
        self.at_once = max_concurrent if at_once is None else min(at_once, max_concurrent)
        self.overlap_min_size = overlap_min_size
        self.running = 0
        self._queue: deque[tuple[Item, asyncio.Future]] = deque()
        self._queued_size = 0  # vectors waiting
        self.fill, self.fill_max_s = fill, fill_max_s
        self._fill_until: int | None = None  # queued vectors the next batch waits for, if filling
        self._fill_timer: asyncio.TimerHandle | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, item: Item) -> Result:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        self._queued_size += self.size_of(item)
        self._start_batches()
        return await future

    def _start_batches(self) -> None:
        while self.running < self.max_concurrent and self._queue:
            if self.running >= self.at_once and self._queued_size < self.overlap_min_size:
                return  # small work waits for a batch in flight to end
            if self._fill_until is not None:
                if self._queued_size < min(self._fill_until, self.max_batch_size):
                    return  # filling: the timer or the next arrival starts it
                self._stop_filling()
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

    def _stop_filling(self) -> None:
        self._fill_until = None
        if self._fill_timer is not None:
            self._fill_timer.cancel()
            self._fill_timer = None

    def _filled(self) -> None:
        self._fill_timer = None
        self._fill_until = None
        self._start_batches()

    def _start_filling(self, requests: int, answered: int, took_s: float) -> None:
        """A batch of `requests` (`answered` vectors) ended after `took_s`: let its clients' next
        requests in."""
        wait_s = min(self.fill * took_s, self.fill_max_s)
        if wait_s <= 0 or requests < 2 or self._fill_until is not None:
            return  # one client answered: whatever it sends next is a batch of its own anyway
        self._fill_until = self._queued_size + max(1, int(FILL_SHARE * answered))
        self._fill_timer = asyncio.get_running_loop().call_later(wait_s, self._filled)

    async def _run(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
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
            if self.fill > 0 and self.running == 0:  # never while a slot is busy with another batch
                self._start_filling(len(batch), sum(self.size_of(item) for item, _ in batch),
                                    loop.time() - started)
            self._start_batches()
