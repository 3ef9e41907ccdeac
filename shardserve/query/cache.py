"""A least-recently-used cache bounded by the bytes of what it holds, safe across threads.

Why by bytes: a shard keeps per-filter state (matching ids, selectors, gathered vectors) whose size
goes from a few bytes to a copy of the shard; a bound by count lets a few large entries hold
gigabytes. Why a lock: a shard searches small batches on its event loop and large ones in an
executor thread at the same time, and both read and fill these caches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class ByteBoundedCache:
    """`get`/`put` by key; the least recently used entries go first once the total passes
    `max_bytes` (a size given by the caller, who counts the key in it when the key is large). An
    entry larger than the whole bound is not kept. Evicting only drops the cache's reference: a
    caller still holding a value keeps it alive."""

    def __init__(self, max_bytes: int, max_entries: int = 256):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Any, value: Any, size: int) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries

    def values(self) -> list[Any]:
        with self._lock:
            return [value for value, _ in self._entries.values()]
