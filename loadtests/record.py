"""Records (docs/operations.md, "Sweeps and the knee"): one JSON per run plus a PNG of
latency and QPS against load.

CLI used by the shell scripts:
python -m loadtests.record --name N --url URL --out DIR LEVEL.json [LEVEL.json ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from loadtests.report import find_knee
from shardserve.runtime.procfs import cpu_model

RECORDS = Path(__file__).resolve().parent / "records"


def machine() -> dict:
    return {"cores": len(os.sched_getaffinity(0)), "cpu_model": cpu_model(),
            "python": platform.python_version()}


def index_info(url: str) -> dict:
    """What the server says it serves (GET /v1/index), so the record names its index."""
    import httpx

    try:
        info = httpx.get(url.rstrip("/") + "/v1/index", timeout=5).json()
    except Exception:
        return {}
    return {"version": info.get("index_version"), "factory": info.get("index_factory"),
            "shards": len(info.get("shards", [])), "num_vectors": info.get("num_vectors")}


VEGETA_TOOL = "vegeta"


def header(name: str, tool: str | dict | None = VEGETA_TOOL, **fields) -> dict:
    """What every record starts with: its name, when, on which machine, with which load tool
    (`tool=None`: no load generator, e.g. in-process timings); `fields` follow."""
    record: dict = {"name": name, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "machine": machine()}
    if tool == VEGETA_TOOL:
        from loadtests.vegeta_run import vegeta_version

        tool = {"name": "vegeta", "version": vegeta_version()}
    if tool is not None:
        record["tool"] = tool
    record.update(fields)
    return record


def new_record(name: str, levels: list[dict], index: dict, tool: str | dict = VEGETA_TOOL, **extra) -> dict:
    record = header(name, tool, index=index, levels=levels)
    knee = find_knee(levels) if len({lv["mode"] for lv in levels}) == 1 else None
    if knee:
        record["knee"] = knee
    record.update(extra)
    return record


@contextlib.contextmanager
def work_dir(kept: str | None, prefix: str) -> Iterator[Path]:
    """Where a benchmark writes its data: `kept` (the user's `--work`, left in place), else a temp
    dir removed at the end (bench-scale writes 2.7 GB)."""
    if kept:
        yield Path(kept)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as temp:
        yield Path(temp)


def save(record: dict, out_dir: Path = RECORDS, plot_levels: bool = True) -> Path:
    """`out_dir/<name>.json` (+ a PNG of its levels, when it has several and `plot_levels`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{record['name']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    levels = record.get("levels", []) if plot_levels else []
    if len({lv.get("label") for lv in levels}) > 1:
        plot_comparison(record, path.with_suffix(".png"))
    elif len(levels) > 1:
        plot(record, path.with_suffix(".png"))
    return path


def plot_comparison(record: dict, png: Path) -> None:
    """Benchmark records compare systems, not loads: queries/s and p50 per (system, clients)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{lv['label']} c={lv['value']:g}" for lv in record["levels"]]
    fig, (ax_qps, ax_lat) = plt.subplots(1, 2, figsize=(12, 0.45 * len(names) + 1.5))
    ax_qps.barh(names, [lv["queries_per_s"] for lv in record["levels"]], color="tab:green")
    ax_qps.set_xlabel("queries / s")
    ax_lat.barh(names, [lv["p50_ms"] for lv in record["levels"]], label="p50")
    ax_lat.barh(names, [lv.get("compute_p50_ms") or 0 for lv in record["levels"]], label="compute p50")
    ax_lat.set_xscale("log")
    ax_lat.set_xlabel("ms")
    ax_lat.set_yticklabels([])
    ax_lat.legend()
    for ax in (ax_qps, ax_lat):
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(record["name"])
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def plot(record: dict, png: Path) -> None:
    """Latency (p50/p99, split into compute and interface+queue) and QPS against load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(record["levels"], key=lambda lv: lv["value"])
    load = [lv["value"] for lv in levels]
    fig, (ax_lat, ax_qps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_lat.plot(load, [lv["p50_ms"] for lv in levels], "o-", label="p50")
    ax_lat.plot(load, [lv["p99_ms"] for lv in levels], "o-", label="p99")
    if all(lv.get("compute_p50_ms") is not None for lv in levels):
        ax_lat.plot(load, [lv["compute_p50_ms"] for lv in levels], "s--", label="compute p50")
        ax_lat.plot(load, [lv["queue_p50_ms"] for lv in levels], "s--", label="interface+queue p50")
    ax_qps.plot(load, [lv["qps"] for lv in levels], "o-", color="tab:green", label="QPS")
    knee = record.get("knee")
    for ax in (ax_lat, ax_qps):
        ax.set_xlabel(levels[0]["mode"])
        ax.set_xscale("log", base=2)
        if knee:
            ax.axvline(knee["value"], color="grey", linestyle=":", label=f"knee @ {knee['value']}")
        ax.legend()
        ax.grid(alpha=0.3)
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_yscale("log")
    ax_qps.set_ylabel("requests / s")
    fig.suptitle(record["name"])
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--name", required=True)
    cli.add_argument("--url", required=True)
    cli.add_argument("--out", default=str(RECORDS))
    cli.add_argument("--vegeta-version", default="unknown")
    cli.add_argument("--queries", choices=("vector", "text"), default="vector",
                     help="what the requests asked by (a text sweep's knee is the embedder's)")
    cli.add_argument("levels", nargs="+", help="level JSON files written by loadtests.report")
    args = cli.parse_args()
    levels = [json.loads(Path(p).read_text()) for p in args.levels]
    record = new_record(args.name, levels, index_info(args.url),
                        {"name": "vegeta", "version": args.vegeta_version}, queries=args.queries)
    path = save(record, Path(args.out))
    knee = record.get("knee")
    for lv in sorted(levels, key=lambda lv: lv["value"]):
        print(f"{lv['mode']}={lv['value']:>6}: {lv['qps']:8.1f} QPS  p50 {lv['p50_ms']:7.2f}  "
              f"p99 {lv['p99_ms']:7.2f} ms  compute p50 {lv['compute_p50_ms']}  "
              f"interface+queue p50 {lv['queue_p50_ms']}  codes {lv['status_codes']}")
    if knee:
        print(f"knee: {knee['mode']} {knee['value']} ({knee['qps']} QPS, p50 {knee['p50_ms']} ms)")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
