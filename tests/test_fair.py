"""shardserve.runtime.fair: keys served in turn, each key's calls in order, each key's queue bounded,
failures handed to their callers, and a shutdown that cancels what waits."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.runtime.fair import Busy, FairExecutor


def _blocked(executor: FairExecutor) -> threading.Event:
    """The worker held by a call until the returned event is set: what is submitted meanwhile waits."""
    release, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait()

    executor.submit("holder", hold)
    started.wait()
    return release


def test_a_flood_of_one_key_does_not_go_before_the_others() -> None:
    executor, ran = FairExecutor("t", 1000), []
    release = _blocked(executor)
    futures = [executor.submit("flood", ran.append, ("flood", i)) for i in range(50)]
    futures += [executor.submit("small", ran.append, ("small", i)) for i in range(3)]
    release.set()
    for future in futures:
        future.result()
    assert ran[:6] == [("flood", 0), ("small", 0), ("flood", 1), ("small", 1), ("flood", 2), ("small", 2)]
    assert ran[6:] == [("flood", i) for i in range(3, 50)]
    executor.shutdown()


def test_a_full_key_is_refused_at_once_and_others_are_not() -> None:
    executor = FairExecutor("t", 2)
    release = _blocked(executor)
    executor.submit("a", int)
    executor.submit("a", int)
    with pytest.raises(Busy):
        executor.submit("a", int)
    assert executor.waiting("a") == 2 and executor.submit("b", int) is not None
    release.set()


def test_failures_go_to_their_caller_and_a_shutdown_cancels_what_waits() -> None:
    executor = FairExecutor("t", 10)
    with pytest.raises(ZeroDivisionError):
        executor.submit("a", lambda: 1 / 0).result()
    assert executor.submit("a", lambda: 7).result() == 7  # the worker lives on
    release = _blocked(executor)
    waiting = executor.submit("a", int)
    executor.shutdown()
    release.set()
    assert waiting.cancelled()
    with pytest.raises(RuntimeError):
        executor.submit("a", int)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=60))
def test_any_submissions_run_once_each_in_order_per_key_and_in_turn(keys: list[str]) -> None:
    executor, ran = FairExecutor("t", 100), []
    release = _blocked(executor)
    futures = [executor.submit(key, ran.append, (key, n)) for n, key in enumerate(keys)]
    release.set()
    for future in futures:
        future.result()
    executor.shutdown()
    assert sorted(ran, key=lambda call: call[1]) == list(zip(keys, range(len(keys)), strict=True))
    for key in set(keys):  # each key's calls in the order they came
        assert [n for k, n in ran if k == key] == [n for n, k in enumerate(keys) if k == key]
    # in turn: between two calls of one key, no other key ran twice
    for position, (key, _) in enumerate(ran):
        following = next((i for i in range(position + 1, len(ran)) if ran[i][0] == key), None)
        if following is not None:
            between = [k for k, _ in ran[position + 1:following]]
            assert all(between.count(other) <= 1 for other in set(between))
