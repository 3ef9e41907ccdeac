"""A replica's settled heap: start-up's objects frozen out of the collector, long pauses logged."""

from __future__ import annotations

import gc
import itertools
import logging

import psutil
import pytest

from shardserve.runtime.heap import PauseLog, give_back, settle


def test_settle_freezes_what_exists_so_a_full_collection_walks_only_what_came_after() -> None:
    kept = [[i] for i in range(10_000)]  # start-up's objects (lists are tracked)
    try:
        frozen = settle()
        # another thread of this process (pytest-xdist's channel) may free a frozen object
        # meanwhile, which leaves the count; nothing but a freeze adds to it
        assert frozen >= len(kept) and frozen - 100 <= gc.get_freeze_count() <= frozen
        assert all(o is not kept for o in gc.get_objects(generation=2))  # not walked any more
    finally:
        gc.unfreeze()


def test_a_collection_longer_than_the_bound_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    ticks = itertools.count(step=0.05)  # each clock read 50 ms after the last: every pause 50 ms
    pauses = PauseLog(logging.getLogger("heap-test"), over_ms=20.0, clock=lambda: next(ticks))
    try:
        with caplog.at_level(logging.WARNING, "heap-test"):
            gc.collect(2)
    finally:
        pauses.close()
    assert any("generation 2 paused 50.0 ms" in r.getMessage() for r in caplog.records)
    quiet = PauseLog(logging.getLogger("heap-test"), over_ms=100.0, clock=lambda: next(ticks))
    try:
        caplog.clear()
        gc.collect(2)
    finally:
        quiet.close()
    assert not caplog.records


def test_give_back_hands_freed_heap_pages_to_the_kernel() -> None:
    """Freed C-heap memory below a live allocation stays resident until trimmed (glibc keeps it
    for reuse): what a router holding a replaced index version saw after a swap."""
    rss = psutil.Process().memory_info
    chunks = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MB from malloc's heap, touched
    top = bytearray(64 * 1024)  # allocated last: the freed chunks sit below it
    del chunks
    held = rss().rss
    assert give_back()  # glibc (this project's Linux images)
    assert rss().rss < held - 100 * 2**20
    del top
