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


def test_with_two_workers_a_key_in_progress_holds_one_and_its_next_call_waits_for_it() -> None:
    """A flood's call in progress holds one worker: another key's call runs on the other at once,
    and the flood's next call waits for its first, never beside it (a key's calls in order)."""
    executor = FairExecutor("t", 100, workers=2)
    release = _blocked(executor)  # "holder" on one worker
    second = executor.submit("holder", int)  # the holder's next call: the other worker is free
    other = executor.submit("small", lambda: "small")
    assert other.result(timeout=30) == "small"  # ran while the holder's first call holds a worker
    assert not second.done()  # waits for the holder's call in progress, not beside it
    release.set()
    assert second.result(timeout=30) == 0
    executor.shutdown()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=60), st.integers(2, 4))
def test_many_workers_run_each_call_once_one_call_of_a_key_at_a_time_in_its_order(keys: list[str],
                                                                                   workers: int) -> None:
    executor, ran, running = FairExecutor("t", 100, workers=workers), [], set()
    overlapped = []
    guard = threading.Lock()

    def call(key: str, n: int) -> None:
        with guard:
            overlapped.append(key in running)
            running.add(key)
        threading.Event().wait(0.001)
        with guard:
            running.discard(key)
            ran.append((key, n))
    futures = [executor.submit(key, call, key, n) for n, key in enumerate(keys)]
    for future in futures:
        future.result(timeout=60)
    executor.shutdown()
    assert not any(overlapped)  # never two calls of one key at once
    assert sorted(n for _, n in ran) == list(range(len(keys)))
    for key in set(keys):
        assert [n for k, n in ran if k == key] == [n for n, k in enumerate(keys) if k == key]
