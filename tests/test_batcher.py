"""Adaptive batcher (plain asyncio): batch size follows the queue, errors reach every caller."""

import asyncio

import pytest

from shardserve.query.batcher import AdaptiveBatcher


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
