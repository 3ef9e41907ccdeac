"""Fault injection the tests install: a ShardDeployment subclass that is slow where a test says.

Production classes carry no test switches; a test passes `shard_class=slow_shards(...)` to
`deployments.run.deploy`. The subclass is made inside a function, so Ray pickles it by value and
shard replicas need no access to this file.
"""

from __future__ import annotations

import asyncio
import os

from deployments.shard import ShardDeployment


def slow_shards(load_s: dict[str, float] | None = None, search_s: dict[str, float] | None = None,
                rank0_search_s: dict[str, float] | None = None, slow_calls_log: str | None = None,
                load_after: dict[str, str] | None = None) -> type:
    """Shard name -> extra seconds before it loads (`load_s`), per search call (`search_s`), or per
    search call in that shard's rank-0 replica only (`rank0_search_s`: one slow replica of several).
    `slow_calls_log`: a file each slowed search call appends a line to (the test reads who was called).
    `load_after`: shard name -> a file; the shard loads only once the file exists (the test says when)."""
    load_s, search_s, rank0_search_s = load_s or {}, search_s or {}, rank0_search_s or {}
    load_after = load_after or {}

    class SlowShard(ShardDeployment.func_or_class):
        async def __init__(self, *args, **kwargs):
            from ray import serve

            context = serve.get_replica_context()
            await asyncio.sleep(load_s.get(context.deployment, 0.0))
            if context.deployment in load_after:
                while not os.path.exists(load_after[context.deployment]):
                    await asyncio.sleep(0.05)
            self.delay_s = search_s.get(context.deployment, 0.0)
            if context.rank.rank == 0:
                self.delay_s += rank0_search_s.get(context.deployment, 0.0)
            await super().__init__(*args, **kwargs)

        async def search(self, query: bytes) -> bytes:
            if self.delay_s:
                if slow_calls_log is not None:
                    with open(slow_calls_log, "a") as log:
                        log.write("called\n")
                await asyncio.sleep(self.delay_s)
            return await super().search(query)

        def answer_now(self, query: bytes) -> bytes | None:
            """A slow shard never answers inside the link's receive callback: its frames go to
            `search` (which sleeps), as Serve calls do."""
            return None if self.delay_s else super().answer_now(query)

    return SlowShard
