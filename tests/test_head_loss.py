"""The head node of a multi-node cluster on loopback SIGKILLed and started again under an open loop
of searches (loadtests/head_loss.py, bounded): with Ray's GCS in Redis every request is answered,
no replica restarts, the pointer keeps the last swap, a swap works after, and single writes (their
log a stream in the same Redis) go on through it with none lost, as do a collection's writes and
Chroma's adds; without it (the control) the
cluster's state is gone and the serving nodes with it. Then a worker with a router and shards is
SIGKILLed: the other answers, and its shards are placed again."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.head_loss import run

pytestmark = [pytest.mark.ha, pytest.mark.slow, pytest.mark.data]


def test_the_head_is_lost_and_restarted_under_load_with_and_without_the_store(tmp_path: Path) -> None:
    record = run(tmp_path, rate=40.0, lead_s=8.0, down_s=15.0, after_s=60.0)
    kept, control = record["with_store"], record["control"]
    assert kept["requests"] > 0 and kept["lost"] == 0, kept["errors"]
    assert kept["answered_200"] >= 0.999 * kept["requests"], kept["status_codes"]
    assert kept["replicas_restarted"] == 0, (kept["replicas_before"], kept["replicas_after"])
    assert kept["pointer_ok"] and kept["swap_after_ok"], (kept["swap_before"], kept["swap_after"])
    assert kept["recovered_s"] is not None
    written = kept["writes"]  # the write log in the same Redis: writes through the loss, none lost
    assert written["upserts_acked"] > 0 and written["deletes_acked"] > 0, written
    assert written["upserts_lost"] == 0 and written["deletes_returned"] == 0, written
    assert written["missed_at_once"] == 0, written
    # a collection's writes and Chroma's adds, beside them through the loss: none lost
    collection, chroma = kept["collection_writes"], kept["chroma_adds"]
    assert collection["upserts_acked"] > 0 and collection["upserts_lost"] == 0, collection
    assert collection["deletes_returned"] == 0 and collection["missed_at_once"] == 0, collection
    assert chroma["adds_acked"] > 0 and chroma["adds_lost"] == 0, chroma
    lost = kept["worker_loss"]  # then a worker with a router and shards: the other answers, shards move
    assert lost["answered_200_after_the_kill"] > 0 and lost["shards_placed_again"], lost
    # the control: the failure the store guards against
    assert control["answered_200"] < 0.99 * control["requests"], control["status_codes"]
    assert control["lost"] > 0 and not control["pointer_ok"] and not control["swap_after_ok"]
