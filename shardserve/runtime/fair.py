"""Worker threads shared by many tenants, served in turn: `FairExecutor`.

Why not a ThreadPoolExecutor: its queue is first come, first served, so a flood of one tenant's
work (one collection's searches) puts every other tenant's next call behind all of it. Here each
key has its own queue and the workers take one call from each key with work, in turn (round
robin), and run at most one call of a key at a time: a call waits for at most one call of every
other busy key, whatever their backlogs, and with two workers or more a flood of one key holds one
of them only, so another key's call does not wait for the flood's call in progress either. A key's
calls run in the order they came. Each key's queue is bounded (`max_waiting`): past it `submit`
raises `Busy` at once, so one tenant's backlog, and the memory it holds, stays its own.
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
    """`submit(key, fn, *args)` → a concurrent.futures.Future, run on `workers` threads, keys in
    turn, one call of a key at a time. `initializer` runs once on each worker (e.g. FAISS's thread
    count)."""

    def __init__(self, name: str, max_waiting: int, initializer: Callable[[], Any] | None = None,
                 workers: int = 1):
        if max_waiting < 1 or workers < 1:
            raise BadArgument("max_waiting and workers must be >= 1")
        self.max_waiting = max_waiting
        self._queues: OrderedDict[Hashable, deque] = OrderedDict()  # keys with work, in turn order
        self._running: set[Hashable] = set()  # keys with a call on a worker now
        self._ready = threading.Condition()
        self._closed = False
        self._initializer = initializer
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{n}", daemon=True)
                         for n in range(workers)]
        for thread in self._threads:
            thread.start()

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
            self._ready.notify_all()

    def _next(self, done: Hashable | None) -> tuple[Hashable, tuple[Future, Callable, tuple]] | None:
        """The next call of the first key in turn with none running (`done`: the key whose call
        this worker just ran, free again)."""
        with self._ready:
            if done is not None:
                self._running.discard(done)
                self._ready.notify()  # its next call may wait for a worker
            while not self._closed:
                key = next((key for key in self._queues if key not in self._running), None)
                if key is not None:
                    queue = self._queues.pop(key)
                    call = queue.popleft()
                    if queue:  # back of the turn order
                        self._queues[key] = queue
                    self._running.add(key)
                    return key, call
                self._ready.wait()
            return None

    def _work(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:  # noqa: BLE001 (a setting not applied: the calls still run, never hang)
                logging.getLogger(__name__).exception("the executor's initializer failed")
        done = None
        while (taken := self._next(done)) is not None:
            done, (future, fn, args) = taken
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 (handed to the caller, as an executor does)
                future.set_exception(exc)
            else:
                future.set_result(result)
