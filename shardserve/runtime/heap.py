"""A serving replica's heap, settled once it has started: its start-up objects frozen out of the
cyclic garbage collector, and the collector's pauses counted.

Why: CPython's full (generation-2) collection walks every object the collector tracks, and a
replica holds the objects of Ray, Ray Serve, FAISS's wrappers and this package from the moment it
starts. A full collection of them is a pause of the whole event loop, on a request path that runs
on one: every request inside waits, and an open loop's arrivals pile up behind it at the edge.
`gc.freeze()` (Python 3.7+) moves what exists after start-up into a permanent generation the
collector no longer walks, so a later collection costs what the requests allocated since.
`python -m lab.gc_pause` measures a full collection of the serving stack with and without it.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time


def settle() -> int:
    """Collect once, then freeze everything left: the objects start-up made, for the process's life.
    Returns how many objects are frozen. Call once a replica is ready to serve."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def settled(logger: logging.Logger, over_ms: float = 20.0) -> PauseLog:
    """`settle()`, then log every later collection longer than `over_ms`: what a replica calls once
    it is ready."""
    settle()
    return PauseLog(logger, over_ms)


class PauseLog:
    """Logs every collection that paused this process longer than `over_ms` (a gc.callbacks hook:
    two clock reads per collection), so a stall in a replica's log can be told from a collection."""

    def __init__(self, logger: logging.Logger, over_ms: float = 20.0, clock=time.perf_counter):
        self.logger, self.over_ms, self.clock = logger, over_ms, clock
        self._started = 0.0
        gc.callbacks.append(self._on_collect)

    def _on_collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self.clock()
            return
        paused_ms = (self.clock() - self._started) * 1000
        if paused_ms > self.over_ms:
            self.logger.warning("garbage collection of generation %s paused %.1f ms (%s objects collected)",
                                info.get("generation"), paused_ms, info.get("collected"))

    def close(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)


def give_back() -> bool:
    """Collect, then hand the C heap's free pages back to the kernel (glibc's malloc_trim): what a
    replica calls once it has let go of a large structure, such as a replaced index version. False
    where the C library has no malloc_trim (not glibc): nothing is handed back there."""
    gc.collect()
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
