"""Interleaved A/B of code revisions on the hot path → loadtests/records/<name>.json.

python -m lab.ab_revisions --index DIR [--rounds 2] [--duration 8] [--name hot-path-ab] REV REV ...

A REV may carry app-arg overrides as JSON after a `+`: `HEAD+{"max_concurrent_batches":2}` (the
same code with other settings); an `"index"` override serves another index (the same code on two
builds of the same data). `--through-serve` runs each revision's own `shardserve serve` instead
(its edge and default admission included, as `make bench`'s headline), at the same levels.

Why: a hot-path change is worth a few percent, and on this shared 2-core machine two `make bench`
runs of the same code differ by more than that. Here every revision runs in every round (order
alternating), each on its own fresh local Ray, and the record keeps every round and the medians.

Each revision is checked out in a temporary git worktree and measured in a child process with that
worktree first on PYTHONPATH, so the driver and every Ray worker (they inherit the environment
`ray.init` starts them with) import that revision's code. A run: 4 s warm-up, then 20 s idle (the
warm pool fills; the idle CPU per process class is recorded), then closed-loop vegeta at the
router's front door: single vectors at c=1 and c=32, 256-vector batches at c=2, each level's CPU per
request read from /proc over the attack.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVE_PORT, FRONT_PORT = 18000, 18001
IDLE_S = 20.0
# (label, concurrency, vectors/request): the levels `--levels` names, and those run by default
KNOWN_LEVELS = {"c1": (1, 0), "c32": (32, 0), "c128": (128, 0), "batch256": (2, 256)}
LEVELS = ("c1", "c32", "batch256")


def queries_of(spec: str):
    """The load's queries: a dataset's, or `embedding-like:DIM` (bench_scale's distribution, for its
    synthetic 4M index)."""
    if spec.startswith("embedding-like:"):
        from loadtests.bench_scale import embedding_like
        return embedding_like(1000, int(spec.partition(":")[2]), seed=9_999)
    from shardserve.data.datasets import load_dataset
    return load_dataset(spec).queries


def measure_served(index: str, duration_s: float, queries_spec: str, nprobe: int,
                   levels: tuple[str, ...]) -> dict:
    """One run through `shardserve serve INDEX` itself, edge and default admission included, as
    `make bench`'s headline starts it (the revision's own command, its own Ray)."""
    from loadtests.bench import served
    from loadtests.vegeta_run import attack, make_targets, write_targets
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location

    queries, params = queries_of(queries_spec), {"nprobe": nprobe}
    result: dict = {"levels": {}, "index": {"version": read_manifest(Location.parse(index)).index_version},
                    "through": "shardserve serve"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with served(index, work / "serve.log") as url:
            warm = write_targets(work / "warm.jsonl", make_targets(queries, url, 10, params, 0, count=200))
            attack(warm, "concurrency", 8, 4.0, work, "warm-up")
            time.sleep(IDLE_S)  # the warm pool fills, as in the headline's steady wait
            result["levels"] = run_levels(url, queries, params, levels, duration_s, work)
    return result


def run_levels(url: str, queries, params: dict, levels: tuple[str, ...], duration_s: float,  # type: ignore[no-untyped-def]
               work: Path) -> dict:
    """Each closed-loop level against `url`, with its CPU per request by process class."""
    from loadtests.vegeta_run import attack, make_targets, write_targets
    from shardserve.runtime.procfs import CpuMeter

    found = {}
    for label in levels:
        concurrency, batch = KNOWN_LEVELS[label]
        targets = write_targets(work / f"{label}.jsonl", make_targets(
            queries, url, 10, params, batch, count=20 if batch else 1000))
        level = attack(targets, "concurrency", concurrency, duration_s, work, label,
                       queries_per_request=batch or 1, meter=CpuMeter())
        found[label] = {key: level.get(key) for key in (
            "qps", "queries_per_s", "p50_ms", "p99_ms", "compute_p50_ms", "status_codes",
            "cpu_ms_per_request", "machine_cpu", "batch_mean", "batches_per_s")}
    return found


def measure(index: str, duration_s: float, overrides: dict, queries_spec: str = "fashion-mnist",
            nprobe: int = 16, levels: tuple[str, ...] = LEVELS) -> dict:
    """One run of the code importable here (the child's PYTHONPATH decides which revision)."""
    if overrides.pop("through_serve", False):
        return measure_served(index, duration_s, queries_spec, nprobe, levels)
    from shardserve.runtime.ray_session import apply_serving_node_env, ensure_ray, shutdown_ray

    apply_serving_node_env()
    from ray import serve

    from deployments.run import deploy
    from loadtests.vegeta_run import attack, make_targets, write_targets
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location
    from shardserve.runtime.procfs import CpuMeter

    index = overrides.pop("index", index)
    queries, params = queries_of(queries_spec), {"nprobe": nprobe}
    front = f"http://127.0.0.1:{FRONT_PORT}"
    if not ensure_ray(serving_node=True):
        raise SystemExit("error: needs its own Ray, and one is already running here")
    served = read_manifest(Location.parse(index))
    dealt = served.build.params.get("partition", {"kind": "rows"})  # builds before index.partition: rows
    result: dict = {"levels": {}, "index": {"version": served.index_version, "partition": dealt}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
            deploy(index, port=SERVE_PORT, app_name="ab", front_port=FRONT_PORT, **overrides)
            warm = write_targets(work / "warm.jsonl", make_targets(queries, front, 10, params, 0, count=200))
            attack(warm, "concurrency", 8, 4.0, work, "warm-up")
            meter = CpuMeter()
            meter.start()
            time.sleep(IDLE_S)
            result["idle_percent_of_a_core"] = {
                cls: round(100 * cpu / IDLE_S, 2) for cls, cpu in sorted(meter.stop().items())}
            result["levels"] = run_levels(front, queries, params, levels, duration_s, work)
        finally:
            shutdown_ray()  # our own Ray (checked above): ending it ends the apps at once
    return result


def in_worktree(script: Path, revision: str, args: list[str]) -> dict:
    """`script --measure *args` in a child process importing `revision`'s code from a temporary
    worktree: the JSON it prints after "RESULT ". Shared by the lab's A/Bs of revisions."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), revision],
                       check=True, capture_output=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree), "VEGETA": str(ROOT / ".bin" / "vegeta")}
            out = subprocess.run([sys.executable, str(script.resolve()), "--measure", *args],
                                 cwd=tree, env=env, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if out.returncode or line is None:
                raise SystemExit(f"error: run of {revision} failed:\n{out.stderr[-3000:]}")
            return json.loads(line[len("RESULT "):])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           check=False, capture_output=True)


def run_revision(spec: str, index: str, duration_s: float, queries: str, nprobe: int,
                 levels: tuple[str, ...] = LEVELS) -> dict:
    """`measure` in a child process importing the revision's code from a temporary worktree."""
    revision, _, overrides = spec.partition("+")
    return in_worktree(Path(__file__), revision, [
        "--index", index, "--duration", str(duration_s), "--overrides", overrides or "{}",
        "--queries", queries, "--nprobe", str(nprobe), "--levels", ",".join(levels)])


def summarise(runs: dict[str, list[dict]], first: str, levels: tuple[str, ...] = LEVELS) -> dict:
    """Median QPS and CPU per request per level and revision, and each revision's ratio to `first`."""
    summary: dict = {}
    for revision, results in runs.items():
        summary[revision] = {}
        for label in levels:
            qps = [r["levels"][label]["queries_per_s"] for r in results]
            cpu = [r["levels"][label]["cpu_ms_per_request"]["total (servers)"] for r in results]
            summary[revision][label] = {"queries_per_s": round(statistics.median(qps), 1),
                                        "cpu_ms_per_request": round(statistics.median(cpu), 3)}
    for revision in runs:
        for label in levels:
            mine, base = summary[revision][label], summary[first][label]
            mine["qps_vs_first"] = round(mine["queries_per_s"] / base["queries_per_s"], 3)
            mine["cpu_vs_first"] = round(mine["cpu_ms_per_request"] / base["cpu_ms_per_request"], 3)
    return summary


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("revisions", nargs="*")
    cli.add_argument("--index", required=True)
    cli.add_argument("--rounds", type=int, default=2)
    cli.add_argument("--duration", type=float, default=8.0)
    cli.add_argument("--name", default="hot-path-ab")
    cli.add_argument("--queries", default="fashion-mnist", help="a dataset, or embedding-like:DIM")
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--levels", default=",".join(LEVELS), help=f"of {', '.join(KNOWN_LEVELS)}")
    cli.add_argument("--through-serve", action="store_true",
                     help="through each revision's `shardserve serve` (edge, default admission), not the "
                          "router's door; no overrides then")
    cli.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    cli.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    args = cli.parse_args()
    index = str(Path(args.index).resolve())
    levels = tuple(args.levels.split(","))
    if not set(levels) <= set(KNOWN_LEVELS):
        raise SystemExit(f"error: --levels: of {', '.join(KNOWN_LEVELS)}")
    if args.measure:
        print("RESULT " + json.dumps(measure(index, args.duration, json.loads(args.overrides), args.queries,
                                             args.nprobe, levels)), flush=True)
        return
    if len(args.revisions) < 2:
        raise SystemExit("error: give at least two revisions to compare")
    def short(spec: str) -> str:
        revision, plus, overrides = spec.partition("+")
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", revision], check=True,
                              capture_output=True, text=True).stdout.strip() + plus + overrides

    resolved = {spec: short(spec) for spec in args.revisions}
    runs: dict[str, list[dict]] = {resolved[r]: [] for r in args.revisions}
    for round_number in range(args.rounds):
        order = list(runs) if round_number % 2 == 0 else list(runs)[::-1]
        for revision in order:
            # `revision` is resolved: a short hash (+ overrides)
            spec = revision
            if args.through_serve:
                if "+" in revision:
                    raise SystemExit("error: --through-serve runs each revision's defaults: no overrides")
                spec = revision + '+{"through_serve": true}'
            result = run_revision(spec, index, args.duration, args.queries, args.nprobe, levels)
            result["round"] = round_number
            runs[revision].append(result)
            print(f"round {round_number} {revision}: " + ", ".join(
                f"{label} {lv['queries_per_s']} q/s {lv['cpu_ms_per_request']['total (servers)']} ms CPU/req"
                for label, lv in result["levels"].items()), flush=True)
    from loadtests.record import header, save

    subjects = {resolved[r]: subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%s",
                                             r.partition("+")[0]],
                                            check=True, capture_output=True, text=True).stdout.strip()[:160]
                for r in args.revisions}
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location

    manifest = read_manifest(Location.parse(index))
    record = header(args.name, index={"uri": index, "version": manifest.index_version,
                                      "factory": manifest.index_factory, "shards": len(manifest.shards),
                                      "replicas": 1, "params": {"nprobe": args.nprobe}},
                    queries=args.queries)
    record.update(revisions=subjects, rounds=args.rounds, duration_s=args.duration, runs=runs,
                  through="shardserve serve (edge, default admission)" if args.through_serve
                  else "the router's front door",
                  levels=list(levels), summary=summarise(runs, resolved[args.revisions[0]], levels),
                  not_covered=[f"one index ({manifest.index_factory}, {len(manifest.shards)} shards, "
                               "1 replica each)",
                               "closed loop only", "this 2-core machine only"])
    print(json.dumps(record["summary"], indent=1))
    print(f"record: {save(record, plot_levels=False)}")


if __name__ == "__main__":
    main()
