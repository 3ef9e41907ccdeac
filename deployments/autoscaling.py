"""Shard autoscaling from the measured knee: Serve's queue-depth autoscaler, one per shard deployment.

Each shard deployment scales on its OWN queue depth (ongoing + queued calls per replica): a query is
as slow as its slowest shard, so the shard that is behind gets replicas first, not all shards alike
(tests/test_autoscaling_serve.py shows the slow shard scaling alone). The target depth per replica is
the depth at the latency knee that `shardserve tune` measured: past it, latency is queueing.
Up fast (`upscale_delay_s`), down slowly (`downscale_delay_s`), within [min_replicas, max_replicas].

A custom class policy (Serve's `policy_function`) was tried first; on Ray 2.60 its decisions were
logged but not applied to these deployments, while the built-in policy works, so this module
configures the built-in one.
"""

from __future__ import annotations


def autoscaling_config(knee_depth: float, min_replicas: int = 1, max_replicas: int = 4,
                       upscale_delay_s: float = 3.0, downscale_delay_s: float = 60.0,
                       metrics_interval_s: float = 1.0, look_back_period_s: float = 3.0) -> dict:
    """A Serve autoscaling_config for one shard deployment, targeting the knee's queue depth."""
    if knee_depth <= 0:
        raise ValueError("knee_depth must be > 0")
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError("need 1 <= min_replicas <= max_replicas")
    return {
        "min_replicas": min_replicas, "max_replicas": max_replicas,
        "target_ongoing_requests": knee_depth,
        "upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s,
        "metrics_interval_s": metrics_interval_s, "look_back_period_s": look_back_period_s,
    }
