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

import json
import logging
import math
import os
import time

from shardserve.errors import BadArgument

logger = logging.getLogger("ray.serve")
KNEE_EVENTS_KEY = "knee-passed/{app}/{deployment}"  # GCS key-value (shardserve.runtime.ray_private.kv_get)
KNEE_EVENTS_KEPT = 50
RELEASE = 0.5  # past the knee until the depth per replica falls below half the knee depth


def autoscaling_config(knee_depth: float, min_replicas: int = 1, max_replicas: int = 4,
                       upscale_delay_s: float = 3.0, downscale_delay_s: float = 60.0,
                       metrics_interval_s: float = 1.0, look_back_period_s: float = 3.0,
                       knee_policy: bool = False) -> dict:
    """A Serve autoscaling_config for one shard deployment, targeting the knee's queue depth;
    `knee_policy=True` uses this module's `knee_policy` instead of Serve's built-in policy."""
    if knee_depth <= 0:
        raise BadArgument("knee_depth must be > 0")
    if not 1 <= min_replicas <= max_replicas:
        raise BadArgument("need 1 <= min_replicas <= max_replicas")
    return {
        "min_replicas": min_replicas, "max_replicas": max_replicas,
        "target_ongoing_requests": knee_depth,
        "upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s,
        "metrics_interval_s": metrics_interval_s, "look_back_period_s": look_back_period_s,
        **({"policy": {"policy_function": KNEE_POLICY}} if knee_policy else {}),
    }


def decide(current: int, depth: float, knee_depth: float, min_replicas: int, max_replicas: int) -> int:
    """Knee-aware replica target: enough replicas that each holds at most `knee_depth` requests
    (ongoing + queued) — up at once to that; down one replica per step, and only when one fewer
    replica would hold at most RELEASE x the knee each (a burst's tail does not drop capacity it
    may need again, and the load a new replica took does not send it away); within
    [min_replicas, max_replicas]. Serve applies the upscale/downscale delays to each change. Pure:
    unit-tested on constructed values."""
    wanted = math.ceil(depth / knee_depth) if depth > 0 else min_replicas
    if wanted >= current:
        target = wanted
    elif depth <= (current - 1) * knee_depth * RELEASE:
        target = current - 1
    else:  # fewer replicas would each hold more than RELEASE x the knee: the load is still here
        target = current
    return min(max(target, min_replicas), max_replicas)


KNEE_POLICY = "deployments.autoscaling:knee_policy"
# A router replica is one event loop (plus a quantizer thread): past ~0.8 of a core its ready
# queue grows, and that, not the requests it holds, is the router's knee.
ROUTER_BUSY_TARGET = 0.8


def router_autoscaling_config(min_replicas: int = 1, max_replicas: int = 4,
                              busy_target: float = ROUTER_BUSY_TARGET, upscale_delay_s: float = 3.0,
                              downscale_delay_s: float = 60.0, metrics_interval_s: float = 1.0,
                              look_back_period_s: float = 3.0) -> dict:
    """A Serve autoscaling_config for the router deployment (`AppArgs.router_autoscaling`): the
    knee policy on the cores its replicas want (`ReportsCoresWanted`), `busy_target`
    cores per replica. Router replicas on a node share the door's port (SO_REUSEPORT), and the door
    ends each kept-alive connection after 1,000 requests, so the edge reconnects and a new replica
    gets its share of the traffic. Keep the router on the edge's node (`router_resources`) on a
    cluster."""
    return autoscaling_config(busy_target, min_replicas, max_replicas, upscale_delay_s, downscale_delay_s,
                              metrics_interval_s, look_back_period_s, knee_policy=True)


def with_link_policy(config: dict) -> dict:
    """Shard-link traffic bypasses Serve's request counters, which Serve's built-in policy reads:
    with links on, a shard deployment scales by `knee_policy`, which adds the replicas' reported
    link depth. A policy the user set is kept."""
    if config.get("policy"):
        return config
    return {**config, "policy": {"policy_function": KNEE_POLICY}}


class ReportsCoresWanted:
    """A Serve deployment that scales on the cores it wants (the router): each replica reports, as
    `router_busy`, the cores its process used since its last report, plus the cores it waited for
    in the kernel's run queue (runnable, but the CPU was busy with others), summed over its threads
    (/proc schedstat). Used alone, a router starved on a shared node never looks busy: pinned to
    one core with four shards, it used well under 0.8 of it while requests waited in it, and the
    autoscale ramp saw no stage past its knee (loadtests/autoscale.py --pin-initial). Not its
    queue: behind the edge a router holds at most K requests however slow it is, and when the
    shards are what is slow, a second router would only wait for them too."""

    _cores_since: tuple[float, float] | None = None  # (monotonic s, CPU + run-queue s) of the last report

    def record_autoscaling_stats(self) -> dict[str, float]:
        from shardserve.runtime.procfs import sched_times

        on_cpu, waiting, _, _ = sched_times(os.getpid())
        now, wanted = time.monotonic(), on_cpu + waiting
        since, self._cores_since = self._cores_since, (now, wanted)
        if since is None or now <= since[0]:  # the first report: nothing measured yet
            return {"router_busy": 0.0}
        return {"router_busy": (wanted - since[1]) / (now - since[0])}


def stage_load(ctx) -> float:
    """What the knee policy compares with the knee: a router's replicas report the cores they want
    (`router_busy`: used plus waited for); a shard deployment's load is its queue depth."""
    busy = (ctx.aggregated_metrics or {}).get("router_busy")
    return float(sum(busy.values())) if busy else queue_depth(ctx)


def queue_depth(ctx) -> float:
    """Requests the deployment holds: those through Serve (handles' queued + ongoing) plus those
    on shard links (each replica's time-averaged `link_in_flight`, ShardDeployment)."""
    link = (ctx.aggregated_metrics or {}).get("link_in_flight", {})
    return float(ctx.total_num_requests) + float(sum(link.values()))


def past_knee(current: int, depth: float, knee_depth: float, passed_at: int | None) -> int | None:
    """The replica count at which the queue passed the knee, while it stays past it (a Schmitt
    trigger: in at depth per replica > knee, out below RELEASE x knee, or once the replica count
    changed). Without it a depth hovering at the knee flips the decision each tick, and every
    "no change" restarts Serve's upscale delay, and the scale-up waits many delays."""
    per_replica = depth / max(current, 1)
    if passed_at == current and per_replica >= knee_depth * RELEASE:
        return passed_at
    return current if per_replica > knee_depth else None


def knee_policy(ctx) -> tuple[int, dict]:
    """Serve custom autoscaling policy (`policy_function: deployments.autoscaling:knee_policy`),
    per deployment: a shard's own queue depth against the knee depth (`target_ongoing_requests`), a
    router's cores wanted (used + run-queue wait) against its busy target (`router_autoscaling_config`).

    While the queue is past the knee the policy asks for at least one more replica, so Serve's
    upscale delay runs without restarting; replicas still starting are never scaled away (else a
    dip in depth while they start stops them before they ever serve).

    The moment a deployment's queue passes the knee is what its scaling reaction is measured from,
    so each crossing is logged (controller log) and kept in the GCS key-value store
    (`knee_events`), where a load test or an operator reads it back."""
    depth, knee = stage_load(ctx), float(ctx.config.target_ongoing_requests)
    current = ctx.current_num_replicas
    ceiling = ctx.capacity_adjusted_max_replicas
    target = decide(current, depth, knee, ctx.capacity_adjusted_min_replicas, ceiling)
    before = (ctx.policy_state or {}).get("knee_passed_at")
    passed_at = past_knee(current, depth, knee, before)
    if passed_at is not None:
        target = max(target, min(current + 1, ceiling))
        if before != passed_at:
            event = {"t": time.time(), "depth": round(depth, 2), "knee_depth": knee,
                     "replicas": current, "target": target}
            logger.info("knee passed: %s %s", ctx.deployment_name, event)
            _keep_event(ctx.app_name, ctx.deployment_name, event)
    if ctx.target_num_replicas > current:  # replicas still starting: not judged before they serve
        target = max(target, ctx.target_num_replicas)
    return target, {"knee_passed_at": passed_at}


def _keep_event(app: str, deployment: str, event: dict) -> None:
    """Best effort: a policy must decide even when the key-value store is not reachable."""
    try:
        from shardserve.runtime.ray_private import kv_get, kv_put

        key = KNEE_EVENTS_KEY.format(app=app, deployment=deployment)
        events = json.loads(kv_get(key) or b"[]")[-(KNEE_EVENTS_KEPT - 1):]
        kv_put(key, json.dumps([*events, event]).encode())
    except Exception as exc:
        logger.warning("knee event not stored: %s", exc)


def knee_events(app: str, deployment: str) -> list[dict]:
    """When `deployment` of `app` passed its knee (latest last): wall-clock `t`, the depth seen, the
    knee depth, replicas then and the policy's target. Needs a Ray connection."""
    from shardserve.runtime.ray_private import kv_get

    return json.loads(kv_get(KNEE_EVENTS_KEY.format(app=app, deployment=deployment)) or b"[]")
