"""`shardserve tune RECORD`: the knee of a closed-loop sweep → admission + autoscaling settings.

Reasoning (the numbers are written into the config as comments):
- Admission is the edge's (serving/edge.py): `K` requests inside the router, enough for full
  batches past the knee (2 × the knee concurrency C*); while the edge is shedding, a queue of `Q`
  such that what is admitted waits about the delay target, (K + Q) / peak throughput; while it
  sheds nothing, `B` = max(Q, the default 64) waiting clients; and while shedding, no more inside
  than the router answers in twice the delay target (`--edge-delay-ms`, serving/edge.py), which
  caps the wait when queries cost more than the sweep's. The config's header prints the edge flags.
- Behind the edge, a router replica works on at most K requests (`max_in_flight`: never fewer than
  the edge admits, or it would refuse waiting clients the edge let through), and Serve queues at
  most C* more before the replica (`router_max_queued_requests`, for Serve's own HTTP path).
- All C* in-flight requests must fit into the router's concurrent batches:
  `max_batch_size >= ceil(C* / max_concurrent_batches)`.
- A shard replica sees at most `max_concurrent_batches` calls per router replica (the router queues
  the rest). Each shard deployment autoscales (deployments/autoscaling.py) on its own depth with a
  target of half of them (`knee_depth`): the shard batches wait for is the one that grows, after 3 s;
  it shrinks after 60 s below target.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from deployments.autoscaling import autoscaling_config
from deployments.config import AUTOSCALED_BATCHES, AppArgs, serve_config_yaml
from shardserve.errors import ShardserveError

# The mean time an admitted request spends in front of the shards past capacity (the edge's queue
# and the router), (K + Q) / peak: its p99 under overload is a small multiple of that
# (docs/performance.md, "Admission and overload").
DELAY_TARGET_S = 0.035
# Waiting clients the edge admits while it sheds nothing, at least (serving.edge.DEFAULT_BURST: the
# edge sits above this layer; a test keeps the two equal).
MIN_BURST = 64


def edge_from_knee(knee: dict, delay_target_s: float = DELAY_TARGET_S) -> dict:
    """serving.edge.Admission fields from a knee: K = 2 × the knee concurrency (at least 8),
    Q = peak throughput × `delay_target_s` - K (at least 1), B = max(Q, MIN_BURST)."""
    if knee.get("mode", "concurrency") != "concurrency":
        raise ShardserveError("tune needs a closed-loop (concurrency) sweep: loadtests/sweep.sh -c ...")
    in_flight = max(8, 2 * int(knee["value"]))
    queue = max(1, math.ceil(float(knee["peak_qps"]) * delay_target_s) - in_flight)
    return {"max_in_flight": in_flight, "max_burst": max(queue, MIN_BURST), "max_queue": queue}


def settings_from_knee(knee: dict, max_replicas: int = 4) -> dict:
    """AppArgs overrides derived from a knee (see module docstring)."""
    edge = edge_from_knee(knee)
    knee_concurrency = max(1, int(knee["value"]))
    concurrent_batches = AUTOSCALED_BATCHES  # what the router keeps in flight once shards autoscale
    return {
        "max_in_flight": edge["max_in_flight"],
        "router_max_ongoing_requests": max(2 * knee_concurrency, concurrent_batches),
        "router_max_queued_requests": knee_concurrency,
        "max_batch_size": max(AppArgs.model_fields["max_batch_size"].default,
                              math.ceil(knee_concurrency / concurrent_batches)),
        "shard_max_ongoing_requests": 2 * concurrent_batches,
        "shard_autoscaling": autoscaling_config(
            knee_depth=max(1, concurrent_batches // 2), max_replicas=max_replicas,
            upscale_delay_s=3, downscale_delay_s=60, knee_policy=True),
    }


def embedder_settings_from_knee(knee: dict, max_replicas: int = 4) -> dict:
    """AppArgs overrides from the knee of a text sweep (loadtests/sweep.sh with TEXT=1) taken with one
    embedder replica (`--arg embedder_autoscaling=null`): every closed-loop client whose text the
    cache misses holds one call in the embedder, so the knee concurrency C* is the embedder's knee
    depth per replica. The embedder autoscales on it (its own queue, the knee policy); the text
    admission lets each router replica have 2 x C* x max_replicas texts waiting, twice what the
    replicas hold at their knees. The edge and the shards keep their own settings: a text's knee
    is not the vector searches'."""
    if knee.get("mode", "concurrency") != "concurrency":
        raise ShardserveError("tune needs a closed-loop (concurrency) sweep: "
                              "TEXT=1 loadtests/sweep.sh -c ...")
    depth = max(1, int(knee["value"]))
    return {"embedder_autoscaling": autoscaling_config(knee_depth=depth, max_replicas=max_replicas,
                                                       upscale_delay_s=3, downscale_delay_s=60,
                                                       knee_policy=True),
            "max_texts_in_flight": 2 * depth * max_replicas}


def tune_from_record(record_path: str, index_dir: str | None = None) -> str:
    try:
        record = json.loads(Path(record_path).read_text())
    except (OSError, ValueError) as exc:
        raise ShardserveError(f"cannot read record {record_path}: {exc}") from None
    knee = record.get("knee")
    if not knee:
        raise ShardserveError(f"{record_path} has no knee: run a sweep with >= 3 concurrency levels")
    index = index_dir or (record.get("index") or {}).get("path")
    if not index:
        raise ShardserveError("pass --index-dir: the record does not name its index directory")
    if record.get("queries") == "text":
        overrides = embedder_settings_from_knee(knee)
        return (f"# Tuned by `shardserve tune {record_path}`: a text sweep's knee at {knee['mode']} "
                f"{knee['value']} ({knee['qps']} QPS, p50 {knee['p50_ms']} ms, p99 {knee['p99_ms']} ms; "
                f"peak {knee['peak_qps']} QPS): the embedder's knee depth, per replica\n"
                + serve_config_yaml(index, **overrides))
    overrides = settings_from_knee(knee)
    edge = edge_from_knee(knee)
    flags = (f"--edge-in-flight {edge['max_in_flight']} --edge-burst {edge['max_burst']} "
             f"--edge-queue {edge['max_queue']} --edge-delay-ms {round(2 * DELAY_TARGET_S * 1000)}")
    header = (f"# Tuned by `shardserve tune {record_path}`: knee at {knee['mode']} {knee['value']} "
              f"({knee['qps']} QPS, p50 {knee['p50_ms']} ms, p99 {knee['p99_ms']} ms; "
              f"peak {knee['peak_qps']} QPS)\n"
              f"# Admission at the edge ((in flight + queue) = peak x {DELAY_TARGET_S * 1000:g} ms): "
              f"`shardserve serve DIR {flags}` or `shardserve edge-config {flags}`\n")
    return header + serve_config_yaml(index, **overrides)
