"""Shard autoscaling from the measured knee: Serve's queue-depth autoscaler, one per shard deployment.

Each shard deployment scales on its OWN queue depth (ongoing + queued calls per replica): a query is
as slow as its slowest shard, so the shard that is behind gets replicas first, not all shards alike
(tests/test_autoscaling_serve.py shows the slow shard scaling alone). The target depth per replica is
the depth at the latency knee that `shardserve tune` measured: past it, latency is queueing.
Up fast (`upscale_delay_s`), down slowly (`downscale_delay_s`), within [min_replicas, max_replicas].

Two policies, chosen in the config: Serve's built-in queue-depth policy (default), or `knee_policy`
below (`autoscaling_config(..., knee_policy=True)` → `policy: {policy_function: …}`), whose decision
logic is a pure function. Serve wraps a custom policy with the config's delays and bounds. (In the
first layout, shards and router in one app, a custom policy's decisions were logged but not applied;
with each index version in its own app they are: tests/test_autoscaling_serve.py runs both.)
"""

from __future__ import annotations

import math


def autoscaling_config(knee_depth: float, min_replicas: int = 1, max_replicas: int = 4,
                       upscale_delay_s: float = 3.0, downscale_delay_s: float = 60.0,
                       metrics_interval_s: float = 1.0, look_back_period_s: float = 3.0,
                       knee_policy: bool = False) -> dict:
    """A Serve autoscaling_config for one shard deployment, targeting the knee's queue depth;
    `knee_policy=True` uses this module's `knee_policy` instead of Serve's built-in policy."""
    if knee_depth <= 0:
        raise ValueError("knee_depth must be > 0")
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError("need 1 <= min_replicas <= max_replicas")
    return {
        "min_replicas": min_replicas, "max_replicas": max_replicas,
        "target_ongoing_requests": knee_depth,
        "upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s,
        "metrics_interval_s": metrics_interval_s, "look_back_period_s": look_back_period_s,
        **({"policy": {"policy_function": KNEE_POLICY}} if knee_policy else {}),
    }


def decide(current: int, depth: float, knee_depth: float, min_replicas: int, max_replicas: int) -> int:
    """Knee-aware replica target: enough replicas that each holds at most `knee_depth` requests
    (ongoing + queued) — up at once to that, down one replica per step (a burst's tail does not drop
    capacity it may need again); within [min_replicas, max_replicas]. Serve applies the
    upscale/downscale delays to each change. Pure: unit-tested on constructed values."""
    wanted = math.ceil(depth / knee_depth) if depth > 0 else min_replicas
    target = wanted if wanted >= current else current - 1
    return min(max(target, min_replicas), max_replicas)


KNEE_POLICY = "deployments.autoscaling:knee_policy"


def with_link_policy(config: dict) -> dict:
    """Shard-link traffic bypasses Serve's request counters, which Serve's built-in policy reads:
    with links on, a shard deployment scales by `knee_policy`, which adds the replicas' reported
    link depth. A policy the user set is kept."""
    if config.get("policy"):
        return config
    return {**config, "policy": {"policy_function": KNEE_POLICY}}


def queue_depth(ctx) -> float:
    """Requests the deployment holds: those through Serve (handles' queued + ongoing) plus those
    on shard links (each replica's time-averaged `link_in_flight`, ShardDeployment)."""
    link = (ctx.aggregated_metrics or {}).get("link_in_flight", {})
    return float(ctx.total_num_requests) + float(sum(link.values()))


def knee_policy(ctx) -> tuple[int, dict]:
    """Serve custom autoscaling policy (`policy_function: deployments.autoscaling:knee_policy`),
    per shard deployment: its own queue depth against the knee depth (`target_ongoing_requests`)."""
    return decide(ctx.current_num_replicas, queue_depth(ctx),
                  float(ctx.config.target_ongoing_requests), ctx.capacity_adjusted_min_replicas,
                  ctx.capacity_adjusted_max_replicas), {}
