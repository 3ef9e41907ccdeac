"""Where the router's and a shard's CPU goes under load: py-spy samples while vegeta runs.

Deploys the index on a local Ray (fast ingress), drives the router's front door (transport.http_front,
the path `shardserve serve` sends users to) closed-loop at `--concurrency` for
`--duration` seconds, and samples the router replica and one shard replica with `py-spy record`
(raw collapsed stacks, native frames off). The record keeps, per process, the top frames by own
samples and by inclusive samples, so a change to the hot path can be judged by where time moved.

    python -m lab.profile_hot_path --index indexes/fashion-mnist-ivf1024-4 [--duration 15]
    → loadtests/records/profile-hot-path.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from loadtests.record import index_info, new_record, save
from loadtests.vegeta_run import attack, make_targets, write_targets
from shardserve.data.datasets import load_dataset
from shardserve.runtime.procfs import cmdline, pids_matching, process_class

PORT = 18000
FRONT_PORT = 18002


def top_frames(collapsed: str, limit: int = 25) -> dict:
    """Own and inclusive sample counts per frame from py-spy's raw (collapsed) output:
    lines of `frame;frame;...;frame COUNT`, the leaf last."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples

    def share(counter: Counter[str]) -> list[dict]:
        return [{"frame": frame, "share": round(n / total, 4)} for frame, n in counter.most_common(limit)]

    return {"samples": total, "own": share(own), "inclusive": share(inclusive)}


def _replica_pid(kind: str) -> int:
    for pid in pids_matching(b"ray::ServeReplica:"):
        if process_class(cmdline(pid)) == kind:
            return pid
    raise SystemExit(f"no {kind} replica running")


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--index", required=True)
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--concurrency", type=int, default=32)
    cli.add_argument("--duration", type=float, default=15.0)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--name", default="profile-hot-path")
    args = cli.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()
    from deployments.run import deploy, undeploy
    from shardserve.runtime.ray_session import ensure_ray, shutdown_ray

    queries = load_dataset(args.dataset).queries
    started = ensure_ray(serving_node=True)
    try:
        deploy(args.index, port=PORT, front_port=FRONT_PORT)
        url = f"http://127.0.0.1:{FRONT_PORT}"
        index = {**index_info(url), "replicas": 1, "params": {"nprobe": args.nprobe}}
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            targets = write_targets(work / "t.jsonl", make_targets(
                queries, url, 10, {"nprobe": args.nprobe}, 0, count=1000))
            attack(targets, "concurrency", 8, 3, work, "warm-up")
            profilers = {}
            for kind in ("router", "shards"):
                out = work / f"{kind}.txt"
                profilers[kind] = (out, subprocess.Popen(
                    [py_spy, "record", "--pid", str(_replica_pid(kind)), "--format", "raw",
                     "--rate", "200", "--duration", str(int(args.duration)), "--output", str(out),
                     "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            level = attack(targets, "concurrency", args.concurrency, args.duration, work, "profiled")
            profiles = {}
            for kind, (out, process) in profilers.items():
                process.wait(timeout=args.duration + 30)
                profiles[kind if kind == "router" else "one shard"] = top_frames(out.read_text())
        undeploy()
    finally:
        if started:
            shutdown_ray()
    record = new_record(args.name, [level], index, profiles=profiles,
                        not_covered=["native (C/C++) frames: FAISS and Ray core show as their Python caller",
                                     "processes other than the router and one shard"])
    print(f"record: {save(record)}")
    for kind, profile in profiles.items():
        print(f"\n{kind}: {profile['samples']} samples; top own frames")
        for row in profile["own"][:12]:
            print(f"  {row['share']:6.1%}  {row['frame']}")


if __name__ == "__main__":
    main()
