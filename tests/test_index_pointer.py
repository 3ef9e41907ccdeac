"""The swap protocol's bookkeeping (IndexPointer), without Ray."""

from __future__ import annotations

import pytest

from shardserve.query.index_pointer import ActiveIndex, IndexPointer


def _pointer() -> IndexPointer:
    return IndexPointer(ActiveIndex(0, "/idx/a", "app-index", "aaaa"), stale_after_s=5.0)


def test_activate_moves_generation_and_keeps_previous_for_rollback() -> None:
    pointer = _pointer()
    new = pointer.activate("/idx/b", "app-index-bbbb", "bbbb")
    assert (new.generation, new.index, new.app) == (1, "/idx/b", "app-index-bbbb")
    assert pointer.previous == ActiveIndex(0, "/idx/a", "app-index", "aaaa")
    assert pointer.activate("/idx/c", "app-index-cccc", "cccc").generation == 2
    assert pointer.previous.index == "/idx/b"


def test_drained_only_when_every_live_router_serves_new_generation_with_nothing_old() -> None:
    pointer = _pointer()
    pointer.report("r1", 0, 0, now=100.0)
    pointer.report("r2", 0, 0, now=100.0)
    generation = pointer.activate("/idx/b", "app-index-bbbb", "bbbb").generation
    assert not pointer.drained(generation, now=100.5)  # nobody switched yet
    pointer.report("r1", 1, 0, now=101.0)
    assert not pointer.drained(generation, now=101.0)  # r2 still on generation 0
    pointer.report("r2", 1, 3, now=101.0)
    assert not pointer.drained(generation, now=101.0)  # r2 switched but holds 3 old requests
    pointer.report("r2", 1, 0, now=101.2)
    assert pointer.drained(generation, now=101.2)


def test_a_router_that_stopped_reporting_does_not_block_the_drain() -> None:
    pointer = _pointer()
    pointer.report("gone", 0, 2, now=100.0)
    pointer.report("live", 1, 0, now=110.0)
    assert set(pointer.live_routers(now=110.0)) == {"live"}
    assert pointer.drained(1, now=110.0)


def test_no_live_router_is_not_drained() -> None:
    """Nothing heard yet means nothing is known: the swap must wait, not delete the old index."""
    assert not _pointer().drained(1, now=0.0)


def test_activate_is_a_compare_and_set_on_the_generation() -> None:
    """Two swaps that both read generation 0: the second to activate is refused, the pointer keeps
    the first's version (the refused swap then deletes its own app instead of orphaning it)."""
    from shardserve.query.index_pointer import SwapConflict

    pointer = IndexPointer(ActiveIndex(0, "/idx/a", "app-index-aaaa", "aaaa"))
    assert pointer.activate("/idx/b", "app-b", "bbbb", expected_generation=0).generation == 1
    with pytest.raises(SwapConflict, match="moved to generation 1"):
        pointer.activate("/idx/c", "app-c", "cccc", expected_generation=0)
    assert pointer.active.app == "app-b"
    assert pointer.previous is not None and pointer.previous.app == "app-index-aaaa"


@pytest.mark.parametrize("stored", [b"not json", b"{}", b'{"config_index": "/idx/a", "active": {"x": 1}}',
                                    b'{"config_index": "/idx/a", "active": {"generation": -1, "index": "i", '
                                    b'"app": "a", "version": ""}, "previous": null}'])
def test_a_corrupt_stored_pointer_is_a_clear_error_naming_the_recovery(stored: bytes) -> None:
    from shardserve.errors import ShardserveError

    pointer = IndexPointer(ActiveIndex(0, "/idx/a", "app-index-aaaa", "aaaa"))
    with pytest.raises(ShardserveError, match="corrupt.*shardserve serve"):
        pointer.restore(stored, "/idx/a")
    assert pointer.active.generation == 0 and pointer.active.app == "app-index-aaaa"  # untouched


def test_a_stored_pointer_round_trips() -> None:
    pointer = IndexPointer(ActiveIndex(0, "/idx/a", "app-index-aaaa", "aaaa"))
    pointer.activate("/idx/b", "app-b", "bbbb")
    again = IndexPointer(ActiveIndex(0, "/idx/a", "app-index-aaaa", ""))
    assert again.restore(pointer.stored("/idx/a"), "/idx/a") and again.active == pointer.active
    assert not IndexPointer(ActiveIndex(0, "/idx/z", "z", "")).restore(pointer.stored("/idx/a"), "/idx/z")


def test_a_router_ahead_of_a_reset_pointer_moves_the_pointer_past_it() -> None:
    """After a lost or corrupt stored pointer, IndexControl starts at generation 0 while routers
    still serve generation 3: the pointer moves to 4 so they follow it (they ignore lower ones)."""
    pointer = _pointer()
    pointer.report("r1", 3, 0, now=1.0)
    assert pointer.active.generation == 4 and pointer.active.app == "app-index"
    assert pointer.activate("/idx/b", "app-b", "bbbb", expected_generation=4).generation == 5
