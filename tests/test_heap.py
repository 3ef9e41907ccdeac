"""A replica's settled heap: start-up's objects frozen out of the collector, long pauses logged."""

from __future__ import annotations

import gc
import itertools
import logging

import pytest

from shardserve.runtime.heap import PauseLog, settle


def test_settle_freezes_what_exists_so_a_full_collection_walks_only_what_came_after() -> None:
    kept = [[i] for i in range(10_000)]  # start-up's objects (lists are tracked)
    try:
        frozen = settle()
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
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
