"""Shard autoscaling on a real local Serve: the slow shard scales up alone under load, back down after."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import orjson
import pytest

from deployments.autoscaling import autoscaling_config
from index_build.job import build_index
from loadtests.served import wait_for
from shardserve.data.datasets import load_dataset
from tests.conftest import SERVE_PORT as PORT
from tests.faults import slow_shards

pytestmark = pytest.mark.slow
T = TypeVar("T")


def _running(app: str) -> dict[str, int]:
    from deployments.run import shard_replicas

    return shard_replicas(app)


def _load_while_watching(url: str, body: bytes, count: Callable[[], T], scaled: Callable[[T], bool],
                         deadline_s: float = 60) -> tuple[int, list[T]]:
    """8 closed-loop clients (bounded in time, every answer a 200) while `count()` is read every
    0.5 s; the load ends once `scaled` says so. Returns the requests sent and what was read."""
    history: list[T] = []

    async def run() -> int:
        stop, sent = time.monotonic() + deadline_s, 0

        async def client(http: httpx.AsyncClient) -> None:
            nonlocal sent
            while time.monotonic() < stop:
                response = await http.post(f"{url}/v1/search", content=body)
                assert response.status_code == 200, response.text
                sent += 1

        async def watch() -> None:
            nonlocal stop
            while time.monotonic() < stop:
                history.append(await asyncio.to_thread(count))
                if scaled(history[-1]):
                    stop = time.monotonic()  # scaled: end the load early
                await asyncio.sleep(0.5)

        async with httpx.AsyncClient(timeout=30) as http:
            await asyncio.gather(watch(), *[client(http) for _ in range(8)])
        return sent

    return asyncio.run(run()), history


# Serve's built-in policy sees Serve calls only (transport "serve"); the knee policy also reads the
# depth shard replicas report for their links (the default transport).
@pytest.mark.parametrize("knee_policy", [pytest.param(False, marks=pytest.mark.release), True],
                         ids=["serve-policy-serve-calls", "knee-policy-links"])  # the default on every run
def test_slow_shard_scales_up_alone_and_back_down(ray_cluster, tmp_path: Path, knee_policy: bool) -> None:

    from deployments.run import deploy, undeploy

    index = tmp_path / "idx"
    build_index("fashion-mnist", 3, "IVF64,Flat", str(index), limit=6000, backend="ray")
    # Margins on both sides of the knee: the slow shard holds up to max_concurrent_batches (4 here) calls,
    # the fast ones ~0.1-0.4 (13 batches/s x tens of ms). At knee 1 and 0.15 s, a fast shard's
    # depth hovered near 1 and Serve's policy once scaled it too (a fresh-clone run failed so).
    scaling = autoscaling_config(knee_depth=2, max_replicas=3, upscale_delay_s=1, downscale_delay_s=4,
                                 metrics_interval_s=0.5, look_back_period_s=1.5, knee_policy=knee_policy)
    url = deploy(str(index), port=PORT, app_name="scaling", route_prefix="/scaling",
                 shard_autoscaling=scaling, shard_class=slow_shards(search_s={"shard-001": 0.3}),
                 shard_num_cpus=0.1, router_num_cpus=0.1,
                 shard_transport="link" if knee_policy else "serve", max_concurrent_batches=4)
    body = orjson.dumps({"vector": load_dataset("fashion-mnist", num_queries=1).queries[0], "k": 5},
                        option=orjson.OPT_SERIALIZE_NUMPY)
    try:
        sent, history = _load_while_watching(url, body, lambda: _running("scaling"),
                                             lambda counts: counts.get("shard-001", 0) >= 2)
        assert sent > 0
        peak = max(h.get("shard-001", 0) for h in history)
        assert peak >= 2, history
        assert all(h.get(name, 0) <= 1 for h in history for name in ("shard-000", "shard-002")), history
        assert all(count <= 3 for h in history for count in h.values())
        from deployments.config import index_app_name
        from deployments.shard import replica_startups

        started = replica_startups(index_app_name("scaling"))["shard-001"]  # each replica's start-up
        assert len(started) >= 2 and all(row["process_age_s"] > 0 for row in started), started
        if knee_policy:  # the policy kept when the slow shard's queue passed the knee
            from deployments.autoscaling import knee_events

            events = knee_events(index_app_name("scaling"), "shard-001")
            assert events and events[0]["replicas"] == 1 and events[0]["depth"] > 1, events
        # idle now: the slow shard must come back down
        wait_for(lambda: _running("scaling").get("shard-001", 0) == 1, "the slow shard back at one replica",
                 timeout_s=60, interval_s=1)
    finally:
        undeploy("scaling")


def test_knee_policy_decisions() -> None:
    """Pure decision logic of the custom policy, on constructed values."""
    from deployments.autoscaling import decide, knee_policy

    assert decide(current=1, depth=7, knee_depth=2, min_replicas=1, max_replicas=8) == 4  # up at once
    assert decide(current=1, depth=70, knee_depth=2, min_replicas=1, max_replicas=3) == 3  # capped
    assert decide(current=4, depth=0, knee_depth=2, min_replicas=1, max_replicas=8) == 3  # one step down
    assert decide(current=1, depth=0, knee_depth=2, min_replicas=1, max_replicas=8) == 1  # floor
    assert decide(current=3, depth=6, knee_depth=2, min_replicas=1, max_replicas=8) == 3  # steady
    # the burst a new replica absorbed is still here: 2 replicas at 0.9 of a knee of 1 between
    # them; one would hold 0.9, past half the knee: keep both (it flapped: down while loaded)
    assert decide(current=2, depth=0.9, knee_depth=1, min_replicas=1, max_replicas=3) == 2
    assert decide(current=2, depth=0.5, knee_depth=1, min_replicas=1, max_replicas=3) == 1  # gone
    assert decide(current=4, depth=3.5, knee_depth=2, min_replicas=1, max_replicas=8) == 4  # 3 x 1.17
    assert decide(current=4, depth=3, knee_depth=2, min_replicas=1, max_replicas=8) == 3  # 3 x 1

    from types import SimpleNamespace

    ctx = SimpleNamespace(current_num_replicas=2, target_num_replicas=2, total_num_requests=6.0,
                          aggregated_metrics={},
                          config=SimpleNamespace(target_ongoing_requests=3), policy_state={},
                          capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=5,
                          app_name="a", deployment_name="shard-000")
    assert knee_policy(ctx) == (2, {"knee_passed_at": None})  # 3 per replica: at the knee, not past it
    # Link traffic (reported by each replica) counts as much as Serve's own request count.
    ctx.aggregated_metrics = {"link_in_flight": {"replica-a": 2.5, "replica-b": 3.5}}
    assert knee_policy(ctx) == (4, {"knee_passed_at": 2})  # ceil((6 + 6) / 3)
    # Hovering at the knee after passing it: still one more replica wanted, so Serve's upscale
    # delay keeps running instead of restarting at every "no change".
    ctx.policy_state, ctx.aggregated_metrics = {"knee_passed_at": 2}, {}
    assert knee_policy(ctx) == (3, {"knee_passed_at": 2})
    ctx.total_num_requests = 2.0  # 1 per replica: below half the knee depth, released
    # but one replica would hold 2, past half the knee (1.5): the load is still here, keep both
    assert knee_policy(ctx) == (2, {"knee_passed_at": None})
    ctx.total_num_requests = 1.0  # one replica would hold 1: one step down
    assert knee_policy(ctx) == (1, {"knee_passed_at": None})
    ctx.target_num_replicas = 3  # ...but not while a replica asked for is still starting
    assert knee_policy(ctx) == (3, {"knee_passed_at": None})
    # A router's replicas report the cores they used or waited for; the requests it holds do not count (behind
    # the edge it holds K however fast it is): 1.2 cores against a 0.8 target wants 2 replicas.
    router = SimpleNamespace(current_num_replicas=1, target_num_replicas=1, total_num_requests=40.0,
                             aggregated_metrics={"router_busy": {"replica-a": 1.2}},
                             config=SimpleNamespace(target_ongoing_requests=0.8), policy_state={},
                             capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
                             app_name="a", deployment_name="Router")
    assert knee_policy(router) == (2, {"knee_passed_at": 1})
    router.aggregated_metrics = {"router_busy": {"replica-a": 0.3}}
    assert knee_policy(router) == (1, {"knee_passed_at": None})


def test_past_knee_is_a_schmitt_trigger() -> None:
    from deployments.autoscaling import past_knee

    assert past_knee(current=1, depth=2.1, knee_depth=2, passed_at=None) == 1  # in above the knee
    assert past_knee(current=1, depth=1.2, knee_depth=2, passed_at=1) == 1  # held above half of it
    assert past_knee(current=1, depth=0.9, knee_depth=2, passed_at=1) is None  # out below half
    assert past_knee(current=1, depth=1.9, knee_depth=2, passed_at=None) is None  # not yet in
    assert past_knee(current=2, depth=3.0, knee_depth=2, passed_at=1) is None  # replicas changed
    assert past_knee(current=2, depth=4.2, knee_depth=2, passed_at=1) == 2  # past it again at 2


@pytest.mark.release  # the same policy and round trip as the shards' above, on the router
def test_busy_router_scales_up_and_back_down(ray_cluster, tmp_path: Path) -> None:
    """The router scales on the cores it uses (its knee), not on requests held: under load it
    passes a low busy target and gains a replica, the crossing is kept, and idle it comes back."""
    from deployments.autoscaling import knee_events, router_autoscaling_config
    from deployments.run import deploy, router_replicas, undeploy

    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=6000, backend="ray")
    # (target 0.5: two idle replicas, Ray's own threads included, want ~0.08 cores, ~0.16 on a
    # machine twice as slow per instruction, where a target of 0.3 never stepped down: one fewer
    # replica must hold at most half the target, 0.25; 8 clients make one replica want more than 0.5)
    scaling = router_autoscaling_config(max_replicas=2, busy_target=0.5, upscale_delay_s=0.5,
                                        downscale_delay_s=2, metrics_interval_s=0.5, look_back_period_s=1)
    url = deploy(str(index), port=PORT, app_name="busy", route_prefix="/busy", router_autoscaling=scaling,
                 router_num_cpus=0.1, shard_num_cpus=0.1)
    body = orjson.dumps({"vector": load_dataset("fashion-mnist", num_queries=1).queries[0], "k": 5},
                        option=orjson.OPT_SERIALIZE_NUMPY)
    try:
        assert router_replicas("busy") == 1
        sent, history = _load_while_watching(url, body, lambda: router_replicas("busy"), lambda n: n >= 2)
        assert sent > 0
        assert max(history) == 2, history
        # the crossing, in cores wanted: one replica, past 0.5 (kept rounded to 0.01: at least 0.5)
        events = knee_events("busy", "Router")
        assert events and events[0]["replicas"] == 1 and events[0]["depth"] >= 0.5, events
        # idle now: back to one
        wait_for(lambda: router_replicas("busy") == 1, "the router back at one replica", timeout_s=60,
                 interval_s=1)
    finally:
        undeploy("busy")
