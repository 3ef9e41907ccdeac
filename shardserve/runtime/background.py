"""One long-lived event loop in a daemon thread, for sync code that awaits Serve handles.

Serve caches handles per process and binds them to the loop they were first used on, so a fresh
`asyncio.run` per call would break the next call (and `serve.shutdown`): every sync caller shares
this loop instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import TypeVar

T = TypeVar("T")
_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def run_on_loop(coroutine: Coroutine[object, object, T], timeout_s: float | None = None) -> T:
    """Run `coroutine` on the shared loop and wait for its result (TimeoutError after `timeout_s`)."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="shardserve-loop", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coroutine, _loop).result(timeout=timeout_s)
