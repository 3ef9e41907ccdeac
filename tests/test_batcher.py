"""Adaptive batcher (plain asyncio): batch size follows the queue, errors reach every caller."""

import asyncio

import pytest

from core.batcher import AdaptiveBatcher


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


def test_small_batches_wait_for_the_one_in_flight_large_or_late_ones_overlap() -> None:
    """The overlap rule: a second batch starts for a large queue at once, for a small one only
    after `overlap_after_s` (a slow batch in flight), never beyond `max_concurrent`."""
    started: list[tuple[float, int]] = []
    delay = {"s": 0.05}

    async def handler(batch: list[int]) -> list[int]:
        started.append((asyncio.get_running_loop().time(), sum(batch)))
        await asyncio.sleep(delay["s"])
        return batch

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        batcher = AdaptiveBatcher(handler, max_batch_size=64, max_concurrent=2, size_of=lambda n: n,
                                  overlap_min_size=32, overlap_after_s=10.0)
        t0 = loop.time()
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0)
        small = [asyncio.ensure_future(batcher.submit(1)) for _ in range(5)]
        await asyncio.sleep(0.01)
        assert batcher.running == 1 and batcher.queued == 5  # small: waits for the batch in flight
        large = asyncio.ensure_future(batcher.submit(40))  # 45 queued rows: worth overlapping
        await asyncio.sleep(0.01)
        assert batcher.running == 2 and batcher.queued == 0
        await asyncio.gather(first, *small, large)
        assert started[1][1] == 45 and started[1][0] - t0 < 0.04

        started.clear()  # a slow batch in flight: the small queue goes beside it after the wait
        delay["s"] = 0.3
        slow = AdaptiveBatcher(handler, max_batch_size=64, max_concurrent=2, size_of=lambda n: n,
                               overlap_min_size=32, overlap_after_s=0.05)
        t0 = loop.time()
        calls = [asyncio.ensure_future(slow.submit(1))]
        await asyncio.sleep(0)
        calls += [asyncio.ensure_future(slow.submit(1)) for _ in range(3)]
        await asyncio.gather(*calls)
        assert [size for _, size in started] == [1, 3]
        assert 0.04 < started[1][0] - t0 < 0.2  # after the wait, not after the slow batch (0.3 s)

    asyncio.run(scenario())
