"""Adaptive batcher (plain asyncio): batch size follows the queue, errors reach every caller."""

import asyncio

import pytest

from shardserve.query.batcher import FILL_SHARE, AdaptiveBatcher


def test_low_load_runs_alone_and_a_burst_forms_big_batches() -> None:
    sizes: list[int] = []

    async def handler(batch: list[int]) -> list[int]:
        sizes.append(len(batch))
        await asyncio.sleep(0.05)
        return [x * 2 for x in batch]

    async def scenario() -> list[int]:
        batcher = AdaptiveBatcher(handler, max_batch_size=64, max_concurrent=2)
        assert await batcher.submit(1) == 2  # alone: a batch of one, no waiting
        results = await asyncio.gather(*[batcher.submit(i) for i in range(40)])
        return results

    results = asyncio.run(scenario())
    assert results == [i * 2 for i in range(40)]
    assert sizes[0] == 1
    assert max(sizes[1:]) >= 19  # the burst queued behind two running batches and was taken whole
    assert sum(sizes[1:]) == 40


def test_steady_arrivals_batch_up_when_slots_are_busy() -> None:
    sizes: list[int] = []

    async def handler(batch: list[int]) -> list[int]:
        sizes.append(len(batch))
        await asyncio.sleep(0.03)  # slower than arrivals: a queue must form
        return batch

    async def scenario() -> None:
        batcher = AdaptiveBatcher(handler, max_batch_size=64, max_concurrent=1)

        async def arrive(i: int) -> int:
            await asyncio.sleep(i * 0.002)
            return await batcher.submit(i)

        assert await asyncio.gather(*[arrive(i) for i in range(60)]) == list(range(60))

    asyncio.run(scenario())
    assert max(sizes) >= 10 and len(sizes) < 20


def test_size_cap_counts_vectors() -> None:
    sizes: list[int] = []

    async def handler(batch: list[int]) -> list[int]:
        sizes.append(sum(batch))
        await asyncio.sleep(0.01)
        return batch

    async def scenario() -> None:
        batcher = AdaptiveBatcher(handler, max_batch_size=10, max_concurrent=1, size_of=lambda n: n)
        await asyncio.gather(*[batcher.submit(4) for _ in range(6)])

    asyncio.run(scenario())
    assert max(sizes) <= 10


def test_errors_reach_every_caller_and_the_batcher_recovers() -> None:
    calls = 0

    async def handler(batch: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("shard down")
        return batch

    async def scenario() -> None:
        batcher = AdaptiveBatcher(handler, max_batch_size=8, max_concurrent=1)
        with pytest.raises(RuntimeError, match="shard down"):
            await batcher.submit(1)
        assert await batcher.submit(2) == 2
        assert batcher.running == 0 and batcher.queued == 0

    asyncio.run(scenario())


def test_beyond_at_once_only_large_work_starts_another_batch() -> None:
    """One batch starts at once; a second only when the queue holds `overlap_min_size` vectors."""
    started: list[int] = []

    async def handler(batch: list[int]) -> list[int]:
        started.append(sum(batch))
        await asyncio.sleep(0.05)
        return batch

    async def scenario() -> None:
        batcher = AdaptiveBatcher(handler, max_batch_size=256, max_concurrent=2, size_of=lambda n: n,
                                  at_once=1, overlap_min_size=32)
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.01)
        small = [asyncio.ensure_future(batcher.submit(1)) for _ in range(20)]
        await asyncio.sleep(0.01)
        assert batcher.running == 1 and batcher.queued == 20  # small: waits for the batch in flight
        await asyncio.gather(first, *small)
        assert started == [1, 20]  # then taken whole, as one batch
        large = [asyncio.ensure_future(batcher.submit(256)) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert batcher.running == 2  # two large requests overlap
        await asyncio.gather(*large)
        assert batcher.running == 0 and batcher.queued == 0

    asyncio.run(scenario())


def _closed_loop(fill: float, clients: int = 8, batches: int = 12) -> list[int]:
    """`clients` callers that each send their next request right after their answer (a short hop
    away, as over HTTP), against one batch slot; the batch sizes seen."""
    sizes: list[int] = []

    async def handler(batch: list[int]) -> list[int]:
        sizes.append(len(batch))
        await asyncio.sleep(0.1)  # a fill waits 0.05 s: far longer than the clients' 0.5 ms hop
        return batch

    async def scenario() -> None:
        batcher = AdaptiveBatcher(handler, max_batch_size=64, max_concurrent=1, fill=fill, fill_max_s=1.0)

        async def client(number: int) -> None:
            await asyncio.sleep(number * 0.001)  # they start apart: the first batch is not all of them
            while len(sizes) < batches:
                await batcher.submit(number)
                await asyncio.sleep(0.0005)  # the answer's way back and the next request's way in

        await asyncio.gather(*[client(n) for n in range(clients)])

    asyncio.run(scenario())
    return sizes


def test_without_filling_closed_loop_clients_split_into_alternating_groups() -> None:
    sizes = _closed_loop(fill=0.0)
    assert max(sizes[2:]) < 8  # the groups the start made stay apart: no batch holds every client


def test_filling_lets_the_answered_clients_back_into_one_batch() -> None:
    sizes = _closed_loop(fill=0.5)
    # after the first batches, FILL_SHARE of the clients or more in every batch (the last one is cut
    # short: the clients stop)
    assert min(sizes[4:-1]) >= int(FILL_SHARE * 8), sizes


def test_a_fill_that_never_comes_is_ended_by_its_timer() -> None:
    sizes: list[int] = []

    async def handler(batch: list[int]) -> list[int]:
        sizes.append(len(batch))
        await asyncio.sleep(0.5)
        return batch

    async def scenario() -> None:
        batcher = AdaptiveBatcher(handler, max_batch_size=64, max_concurrent=1, fill=1.0, fill_max_s=10.0)
        alone = asyncio.ensure_future(batcher.submit(0))
        await asyncio.sleep(0.01)  # [0] runs
        pair = asyncio.ensure_future(asyncio.gather(batcher.submit(1), batcher.submit(2)))
        await alone  # after a batch of one no fill: [1, 2] starts at once
        await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(asyncio.gather(*[batcher.submit(i) for i in range(3, 7)]))
        await pair  # its two clients send nothing more: the fill waits in vain
        assert batcher._fill_until == 4 + int(FILL_SHARE * 2)  # the 4 queued and the pair, for its 0.5 s
        assert await asyncio.wait_for(queued, timeout=60) == [3, 4, 5, 6]  # (the timeout guards a hang)

    asyncio.run(scenario())
    assert sizes == [1, 2, 4]  # the timer started what was queued


def test_after_a_batch_of_one_nothing_waits() -> None:
    async def handler(batch: list[int]) -> list[int]:
        await asyncio.sleep(0.01)
        return batch

    async def scenario() -> None:
        batcher = AdaptiveBatcher(handler, max_batch_size=64, max_concurrent=1, fill=1.0, fill_max_s=1.0)
        for number in range(3):  # one client at a time
            assert await batcher.submit(number) == number
            assert batcher._fill_until is None and batcher._fill_timer is None

    asyncio.run(scenario())


def test_a_lone_client_with_several_vectors_is_not_held_either() -> None:
    async def handler(batch: list[int]) -> list[int]:
        await asyncio.sleep(0.01)
        return batch

    async def scenario() -> None:
        batcher = AdaptiveBatcher(handler, max_batch_size=64, max_concurrent=1, size_of=lambda n: n,
                                  fill=1.0, fill_max_s=1.0)
        for vectors in (8, 4):  # one request at a time, of several vectors each
            assert await batcher.submit(vectors) == vectors
            assert batcher._fill_until is None and batcher._fill_timer is None

    asyncio.run(scenario())


def test_fill_is_a_fraction() -> None:
    async def handler(batch: list[int]) -> list[int]:
        return batch

    with pytest.raises(ValueError):
        AdaptiveBatcher(handler, max_batch_size=8, max_concurrent=1, fill=1.5)
