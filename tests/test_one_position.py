"""One search, one log position: two shards that answer a search at different log positions (an
overwrite that moved a point between them landed in between) give the router two copies of one id;
the router's merge keeps the copy of the newest position. Real FAISS shards, a real SQLite log, the
router's own fan-out and merge, in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from shardserve.index.indexes import add_to_copy, train_empty_index
from shardserve.index.partition import Partition
from shardserve.query.api import ParsedQuery
from shardserve.query.fanout import search_batch
from shardserve.query.searcher import ShardSearcher
from shardserve.transport.shard_wire import ShardQuery
from shardserve.writes.follow import ShardWrites
from shardserve.writes.log import WriteLog
from shardserve.writes.ops import Upsert
from shardserve.writes.route import WriteRoute


def test_an_id_moved_between_two_shards_answers_of_one_search_is_answered_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    base = rng.normal(size=(3000, 16)).astype(np.float32)
    empty = train_empty_index("Flat", "l2", base, seed=1)
    ids = np.arange(len(base), dtype=np.int64)
    searchers = [ShardSearcher(add_to_copy(empty, base[s::2], ids[s::2]), "l2", f"s{s}", "v")
                 for s in range(2)]
    trained = empty  # the trained empty index's bytes, as the manifest keeps them
    log_path = tmp_path / "log.sqlite"
    log = WriteLog(log_path)
    shards = [ShardWrites(searcher, number, 2, log_path, 0, lambda: trained)
              for number, searcher in enumerate(searchers)]
    route = WriteRoute(Partition(2))
    moving = [int(i) for i in ids if route.home_of(int(i)) != int(i) % 2][:20]  # base on one, home the other
    assert len(moving) == 20
    answered_at: list[int] = []

    async def call_shard(number: int, query: ShardQuery) -> tuple:
        if number == 1:  # shard 0 answered already: the overwrite lands before shard 1 catches up
            log.append([Upsert(moving[0], base[moving[0]], None)], 0)
        found = shards[number].answer(query)
        answered_at.append(found[4])
        return found

    parsed = ParsedQuery(matrix=base[moving[0]][None], k=10, params=(), single=True, require_full=False)
    result = asyncio.run(search_batch([parsed], call_shard, 2, False, 30.0))[0]
    real = result.ids[0][result.ids[0] >= 0].tolist()
    assert answered_at == [0, 1]  # the two shards answered at two positions
    assert real.count(moving[0]) == 1 and real[0] == moving[0], real
    # the copy kept is the newest one's: with only the older shard's part, the id is there too
    assert moving[0] in shards[0].searcher.answer(ShardQuery(base[moving[0]][None], 10, {}))[1][0]

