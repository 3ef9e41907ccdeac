"""One worker thread shared by many tenants, served in turn: `FairExecutor`.

Why not a ThreadPoolExecutor: its queue is first come, first served, so a flood of one tenant's
work (one collection's searches) puts every other tenant's next call behind all of it. Here each
key has its own queue and the worker takes one call from each key with work, in turn (round
robin): a call waits for at most one call of every other busy key, whatever their backlogs. Each
key's queue is bounded (`max_waiting`): past it `submit` raises `Busy` at once, so one tenant's
backlog, and the memory it holds, stays its own.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

from shardserve.errors import BadArgument, ShardserveError


class Busy(ShardserveError):
    """A key already has `max_waiting` calls waiting."""


class Closed(ShardserveError, RuntimeError):
    """The executor is shut down."""


class FairExecutor:
    """`submit(key, fn, *args)` → a concurrent.futures.Future, run on one worker thread, keys in
    turn. `initializer` runs once on the worker (e.g. FAISS's thread count)."""

    def __init__(self, name: str, max_waiting: int, initializer: Callable[[], Any] | None = None):
        if max_waiting < 1:
            raise BadArgument("max_waiting must be >= 1")
        self.max_waiting = max_waiting
        self._queues: OrderedDict[Hashable, deque] = OrderedDict()  # keys with work, in turn order
        self._ready = threading.Condition()
        self._closed = False
        self._initializer = initializer
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: Hashable, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise Closed("the executor is shut down")
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = deque()
            elif len(queue) >= self.max_waiting:
                raise Busy(f"{len(queue)} calls of this key wait already")
            queue.append((future, fn, args))
            self._ready.notify()
        return future

    def waiting(self, key: Hashable) -> int:
        with self._ready:
            queue = self._queues.get(key)
            return 0 if queue is None else len(queue)

    def shutdown(self) -> None:
        """Stop taking calls; the worker ends after the call it runs (the others are cancelled)."""
        with self._ready:
            self._closed = True
            for queue in self._queues.values():
                for future, _, _ in queue:
                    future.cancel()
            self._queues.clear()
            self._ready.notify()

    def _next(self) -> tuple[Future, Callable, tuple] | None:
        with self._ready:
            while not self._queues and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            key, queue = next(iter(self._queues.items()))
            call = queue.popleft()
            del self._queues[key]
            if queue:  # back of the turn order
                self._queues[key] = queue
            return call

    def _work(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:  # noqa: BLE001 (a setting not applied: the calls still run, never hang)
                logging.getLogger(__name__).exception("the executor's initializer failed")
        while (call := self._next()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 (handed to the caller, as an executor does)
                future.set_exception(exc)
            else:
                future.set_result(result)
