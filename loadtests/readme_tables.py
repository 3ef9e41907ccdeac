"""The results tables of README.md and docs/, rendered from the committed records (never typed by hand).

    python -m loadtests.readme_tables          # rewrite the generated blocks of README.md and docs/*.md
    python -m loadtests.readme_tables --check  # exit 1 if any of them differs from the records
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from loadtests.record import RECORDS
from shardserve.runtime.procfs import SELF_CLASS, SERVE_COMMAND

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def pages() -> list[Path]:
    """Every page that may hold generated blocks: README.md and docs/*.md."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]
CLASSES = ["ingress (HAProxy)", "router", "shards", "other Serve replicas", "Ray system", SERVE_COMMAND,
           "baseline (uvicorn)", "total (servers)", "load generator", SELF_CLASS]
MACHINE = [("busy_percent", "machine busy, % of its cores"), ("idle_percent", "machine idle, % of its cores"),
           ("busy_unaccounted_percent", "busy in no process above, %")]


def _cell(value: object) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return str(value)


def bench_table(record: dict) -> str:
    rows = ["| system | clients | req/s | queries/s | p50 ms | p99 ms | compute p50 ms | server CPU ms/req |",
            "|---|---|---|---|---|---|---|---|"]
    for level in record["levels"]:
        cpu = level.get("cpu_ms_per_request", {})
        rows.append("| " + " | ".join(_cell(v) for v in (
            level["label"], level["value"], level["qps"], level["queries_per_s"], level["p50_ms"],
            level["p99_ms"], level.get("compute_p50_ms"), cpu.get("total (servers)"))) + " |")
    return "\n".join(rows)


def cpu_table(record: dict, clients: int = 32) -> str:
    levels = [lv for lv in record["levels"] if lv["value"] == clients and "cpu_ms_per_request" in lv]
    header = f"| CPU ms per request, c={clients} | " + " | ".join(lv["label"] for lv in levels) + " |"
    rows = [header, "|---" * (len(levels) + 1) + "|"]
    for name in CLASSES:
        values = [lv["cpu_ms_per_request"].get(name) for lv in levels]
        if any(v is not None for v in values):
            label = f"{name} (not in total)" if name == SELF_CLASS else name
            rows.append(f"| {label} | " + " | ".join(_cell(v) for v in values) + " |")
    for key, label in MACHINE:
        values = [lv.get("machine_cpu", {}).get(key) for lv in levels]
        if any(v is not None for v in values):
            rows.append(f"| {label} | " + " | ".join(_cell(v) for v in values) + " |")
    return "\n".join(rows)


def ratios_table(record: dict) -> str:
    rows = ["| ratio (one run) | value | target | met |", "|---|---|---|---|"]
    for name, check in record.get("ratios", {}).items():
        rows.append(f"| {name} | {check['value']} | {check['target']} | {'yes' if check['met'] else 'no'} |")
    return "\n".join(rows)


def hop_table(record: dict) -> str:
    rows = [f"| 4-way fan-out, no FAISS ({record['fanouts']} in a row) | rows | wall p50 ms | "
            "CPU ms per fan-out |", "|---|---|---|---|"]
    for result in record["results"]:
        rows.append(f"| {result['variant']} | {result['rows']} | {_cell(result['wall_ms_p50'])} | "
                    f"{_cell(result['cpu_ms_per_fanout']['total'])} |")
    return "\n".join(rows)


def profile_table(record: dict, top: int = 10) -> str:
    level = record["levels"][0]
    rows = [f"| top own frames under c={level['value']} ({_cell(level['qps'])} req/s) | share of samples |",
            "|---|---|"]
    for process, profile in record["profiles"].items():
        rows.append(f"| **{process}** ({profile['samples']} samples) | |")
        rows += [f"| `{row['frame']}` | {row['share']:.1%} |" for row in profile["own"][:top]]
    return "\n".join(rows)


def headline_table(bench: dict, admission: dict) -> str:
    """README's few figures: the `shardserve serve` command next to a uvicorn + FAISS monolith on
    the same index and queries, alternating (bench's headline), and under each kind of load
    (admission)."""
    ours, theirs = bench["headline"]["headline-served"], bench["headline"]["headline-uvicorn"]
    rows = [f"| {bench['machine']['cores']} cores, 4-shard Fashion-MNIST IVF1024 (nprobe 16), "
            f"{ours['rounds']} alternating rounds | `shardserve serve` | "
            "uvicorn + FAISS, a worker per core |",
            "|---|---|---|",
            f"| 32 clients: requests/s | {_cell(ours['qps_c32'])} | {_cell(theirs['qps_c32'])} |",
            f"| 32 clients: server CPU ms per request | {_cell(ours['cpu_ms_per_request_c32'])} | "
            f"{_cell(theirs['cpu_ms_per_request_c32'])} |",
            f"| 1 client: p50 ms | {_cell(ours['p50_ms_c1'])} | {_cell(theirs['p50_ms_c1'])} |"]
    closed = [lv for lv in admission["levels"] if lv["mode"] == "concurrency"]
    over = next(lv for lv in admission["levels"] if lv["mode"] == "rate")
    v = admission["verdict"]
    rows += ["", "| `shardserve serve` under | answered 200 | p99 ms |", "|---|---|---|"]
    rows += [f"| {lv['value']} waiting clients | {_cell(100 * lv['success_ratio'])} % | "
             f"{_cell(lv['p99_ms'])} |" for lv in closed]
    rows.append(f"| {over['value']} req/s offered (2x capacity) | {_cell(100 * over['success_ratio'])} % "
                f"(goodput {_cell(v['goodput_x_c32'])}x capacity; the rest 503 in p99 "
                f"{_cell(v['shed_p99_ms'])} ms) | {_cell(v['admitted_p99_ms'])} |")
    return "\n".join(rows)


def filter_table(record: dict) -> str:
    """Filtered search on the default `shardserve serve`, per selectivity."""
    base = record["levels"][0]["qps"]
    rows = ["| filter | matching rows | recall@10 (HTTP, vs brute force) | req/s at 32 clients (vs none) "
            "| p99 ms | 200 |", "|---|---|---|---|---|---|"]
    for level in record["levels"]:
        ratio = _cell(round(level["qps"] / base, 3))
        rows.append(f"| {level['filter_label']} | {_cell(level['matching_rows'])} | {_cell(level['recall'])} "
                    f"| {_cell(level['qps'])} ({ratio}) | {_cell(level['p99_ms'])} "
                    f"| {_cell(100 * level['success_ratio'])} % |")
    if record.get("selection"):
        rows += ["", "| choosing a filter's rows, all shards (median) | posting lists ms | a pass over the "
                 "columns ms |", "|---|---|---|"]
        rows += [f"| {c['filter_label']} | {_cell(c['ms_postings'])} | {_cell(c['ms_scan'])} |"
                 for c in record["selection"]]
    return "\n".join(rows)


def admission_table(record: dict) -> str:
    """The default `shardserve serve` at 8, 32, 128 waiting clients and at 2x its capacity."""
    rows = ["| load (default `shardserve serve`) | req/s | 200 | 503 | other | p50 ms | p99 ms (200) "
            "| p99 ms (503) |", "|---|---|---|---|---|---|---|---|"]
    for level in record["levels"]:
        codes = level["status_codes"]
        label = (f"{level['value']} clients, closed loop" if level["mode"] == "concurrency"
                 else f"{level['value']} req/s offered (2x), open loop")
        other = sum(n for code, n in codes.items() if code not in ("200", "503"))
        by_status = level["p99_ms_by_status"]
        rows.append(f"| {label} | {_cell(level['qps'])} | {codes.get('200', 0)} | {codes.get('503', 0)} | "
                    f"{other} | {_cell(level['p50_ms'])} | {_cell(by_status.get('200'))} | "
                    f"{_cell(by_status.get('503'))} |")
    v, stop = record["verdict"], record["ctrl_c"]
    rows += ["", "| goal | met |", "|---|---|"]
    rows += [f"| {name} | {'yes' if met else '**no**'} |" for name, met in v["checks"].items()]
    rows += ["", f"Under overload the 200s' p99 was {_cell(v['admitted_p99_ms'])} ms against a bound of "
             f"{_cell(v['admitted_p99_bound_ms'])} ms; goodput {_cell(v['goodput_x_c32'])}x the 32-client "
             f"throughput. Ctrl-C: exit {stop['exit_code']} after {_cell(stop['seconds'])} s."]
    return "\n".join(rows)


def autoscale_table(record: dict, goal_s: float = 5.0) -> str:
    """Per shard: when its queue passed the knee, how long until a new replica was RUNNING, and
    how that replica started (the replica the burst added: the first one ready after the crossing):
    in a warm worker of the pool (shardserve.runtime.warm_pool) or a process spawned for it."""
    phases = record["phases"]
    burst = next((p for p in phases if p["multiple_of_knee"] > 1), phases[0])
    pool = record.get("warm_pool") or {}
    share = pool.get("mean_cpu_share_of_a_core")
    rows = [f"Warm pool when the {burst['multiple_of_knee']:g}× burst began: "
            f"{_cell(burst.get('warm_workers_at_start'))} idle workers on the node (target "
            f"{_cell(pool.get('target'))}); each, measured idle for {_cell(pool.get('measured_s'))} s "
            f"before the ramp: {_cell(pool.get('mean_rss_anon_mb'))} MB of its own memory, "
            f"{_cell(None if share is None else 100 * share)} % of a core.", "",
            "| stage | knee crossings | first passed the knee (s into the run) | → new replica RUNNING "
            f"s (goal ≤ {goal_s:g}) | it ran in a warm worker | its constructor s | index load s |",
            "|---|---|---|---|---|---|---|"]
    for name, reaction in record["knee_reactions"].items():
        crossed = [e["t"] for e in record["knee_events"].get(name, []) if e["t"] >= record["start"]]
        added = [r for r in record["replica_startups"].get(name, [])
                 if crossed and r["ready_at"] >= crossed[0]]
        start = added[0] if added else {}
        warm = reaction.get("warm_worker")
        rows.append(f"| {name} | {reaction['crossings']} | {_cell(reaction['passed_knee_s'])} | "
                    f"{_cell(reaction['reaction_s'])} | "
                    f"{'–' if warm is None else ('yes' if warm else 'no')} | "
                    f"{_cell(start.get('constructor_s'))} | {_cell(start.get('index_load_s'))} |")
    return "\n".join(rows)


def burst_line(record: dict) -> str:
    """The burst phase's requests by status (autoscale records that keep `burst_requests`)."""
    burst = record["burst_requests"]
    parts = [f"{row['count']:,} × {code} (p50 {_cell(row['p50_ms'])} ms, p99 {_cell(row['p99_ms'])} ms)"
             for code, row in burst["by_status"].items()]
    return f"During the burst: {', '.join(parts)}; anything else (timeouts, errors): {burst['other']}."


def shard_start_table(record: dict) -> str:
    rows = [f"| {record['index']['shards']} shards × {record['replicas_per_shard']} replicas, started at "
            "once | replicas | IVF lists mapped | process age when ready s | CPU s | index load s | own "
            "memory (RssAnon) MB | mapped file pages (RssFile) MB | own memory, all replicas MB |",
            "|---|---|---|---|---|---|---|---|---|"]
    for mode, result in record["modes"].items():
        m = result["summary"]
        rows.append(f"| `shard_mmap: {str(mode == 'mmap').lower()}` | {m['replicas']} | "
                    f"{'yes' if m['mmapped'] else 'no'} | {_cell(m['mean_process_age_s'])} | "
                    f"{_cell(m['mean_cpu_s'])} | {_cell(m['mean_index_load_s'])} | "
                    f"{_cell(m['mean_rss_anon_mb'])} | {_cell(m['mean_rss_file_mb'])} | "
                    f"{_cell(m['sum_rss_anon_mb'])} |")
    return "\n".join(rows)


def scan_cost_table(record: dict) -> str:
    """FAISS alone, per query: what the sharded path computes (shards dealt by IVF list as built, and
    the same vectors dealt by row) against the unsharded index."""
    shards = record["index"]["shards"]
    rows = [f"| batch | quantizer ms | {shards} shard scans (whole lists, as served) ms | the same, query "
            "by query ms | query by query, rows in arrival order ms | "
            f"{shards} shard scans dealt by row ms | unsharded scan ms | "
            "unsharded full search ms | sharded FAISS / unsharded full search |",
            "|---|---|---|---|---|---|---|---|---|"]
    rows += [f"| {r['batch']} | {r['quantizer_ms']:.3f} | {r['shard_scans_ms']:.3f} | "
             f"{r['shard_scans_query_major_ms']:.3f} | "
             f"{r['shard_scans_arrival_order_ms']:.3f} | {r['shard_scans_by_rows_ms']:.3f} | "
             f"{r['unsharded_scan_ms']:.3f} | {r['monolith_ms']:.3f} | {r['sharded_vs_monolith']:.2f} |"
             for r in record["scan_cost"]]
    return "\n".join(rows)


def bench_scale_table(record: dict) -> str:
    """The streaming build at scale: memory, speed against one process, recall over HTTP."""
    d, b, served, single = record["dataset"], record["build"], record["served"], record["single_process"]
    peak, goal = b["peak_rss_mb"], b["goal_mb"]
    evaluated = record.get("eval_peak_rss_mb") or {}
    rows = ["| data | index (`--index auto`) | build s | vectors/s/core (one process) | peak RSS MB: "
            "driver / any Ray process (goal) | recall@10 over HTTP (goal) | `include` captions wrong | "
            "`eval` peak RSS MB (the base set's MB) |",
            "|---|---|---|---|---|---|---|---|"]
    size = f"{d['bytes'] / 2**30:.2f} GiB"
    rows.append(f"| {d['rows']:,} × {d['dim']} in {d['files']} parquet files ({size}) | "
                f"`{b['factory']}`, {b['shards']} shards | {_cell(b['seconds'])} | "
                f"{_cell(b['vectors_per_s_per_core'])} ({_cell(single['vectors_per_s_per_core'])}: "
                f"{b['vs_single_process_per_core']:.2f}×) | {_cell(peak['driver'])} / "
                f"{_cell(peak['any_ray_process'])} (≤ {goal['driver']} / ≤ {goal['any_ray_process']}) | "
                f"{served['recall']:.4f} at nprobe {served['params']['nprobe']} "
                f"(≥ {served['goal_recall']}) | "
                f"{served['include']['wrong_captions']} of {served['include']['hits']} | "
                f"{_cell(evaluated.get('eval_process'))} ({_cell(evaluated.get('base_set_mb'))}) |")
    return "\n".join(rows)


def glove_table(record: dict) -> str:
    """GloVe-50 from parquet: the streaming build, recall over HTTP, QPS at the front door."""
    d, b, served = record["dataset"], record["build"], record["served"]
    rows = ["| data | index | build s | recall@10 over HTTP (goal) | `include` words wrong | "
            "req/s at 1 / 32 clients | p99 ms at 32 | server CPU ms/req at 32 |",
            "|---|---|---|---|---|---|---|---|"]
    one, many = (next(lv for lv in record["levels"] if lv["value"] == c) for c in (1, 32))
    include = served["include"]
    rows.append(f"| {d['rows']:,} × {d['dim']}, {d['metric']}, {d['files']} parquet files | "
                f"`{b['factory']}`, {b['shards']} shards (streamed) | {_cell(b['seconds'])} | "
                f"{served['recall']:.4f} at nprobe {served['params']['nprobe']} "
                f"(≥ {served['goal_recall']}) | {include['wrong_words']} of {include['hits']} | "
                f"{_cell(one['qps'])} / {_cell(many['qps'])} | "
                f"{_cell(many['p99_ms'])} | {_cell(many['cpu_ms_per_request'].get('total (servers)'))} |")
    if record.get("filtered"):
        rows += ["", "| filter (metadata `initial`: first character) | matching words | recall@10 over "
                 "HTTP, vs brute force over them (goal) |", "|---|---|---|"]
        rows += [f"| {f['filter_label']} | {_cell(f['matching_rows'])} | {_cell(f['recall'])} "
                 f"(≥ {f['goal_recall']}) |" for f in record["filtered"]]
    return "\n".join(rows)


def hygiene_table(record: dict) -> str:
    """Each process-hygiene knob against the default, mean of the rounds (fresh Ray each)."""
    summary = record["summary"]
    rows = [f"| variant ({record['rounds']} rounds, fresh Ray each) | idle stack, % of a core | level | "
            "req/s (runs) | vs default | server CPU ms/req | vs default |", "|---|---|---|---|---|---|---|"]
    for name, entry in summary.items():
        for level, values in entry["levels"].items():
            runs = ", ".join(f"{q:,.0f}" for q in values["qps_runs"])
            rows.append(f"| {name} | {_cell(entry['idle_percent_of_a_core'])} | {level} | "
                        f"{_cell(values['qps'])} ({runs}) | {_cell(values.get('qps_vs_default'))} | "
                        f"{values['cpu_ms_per_request']:.3f} | {_cell(values.get('cpu_vs_default'))} |")
    idle = record["runs"]["default"][0]["idle_percent_of_a_core"]
    rows += ["", "| idle, default (round 1): process | % of a core |", "|---|---|"]
    rows += [f"| {name} | {value} |" for name, value in sorted(idle.items(), key=lambda kv: -kv[1]) if value]
    return "\n".join(rows)


def blas_rows_table(record: dict) -> str:
    """The router's coarse quantizer per query by batch rows: FAISS's per-query kernels vs BLAS."""
    rows = ["| batch rows | per-query kernels, us per query | BLAS, us per query | BLAS / kernels |",
            "|---|---|---|---|"]
    rows += [f"| {r['rows']} | {r['kernels_ms_per_query'] * 1000:.1f} | {r['blas_ms_per_query'] * 1000:.1f} "
             f"| {r['blas_vs_kernels']} |" for r in record["rows"]]
    return "\n".join(rows)


def _revision_label(record: dict, revision: str) -> str:
    subject = record["revisions"].get(revision.partition("+")[0], "")
    return f"`{revision}` {subject[:70]}{'…' if len(subject) > 70 else ''}"


def _index_label(record: dict, revision: str) -> str:
    served = record["runs"][revision][0]["index"]
    return f"shards dealt by {served['partition']['kind']} (version `{served['version']}`)"


def ab_table(record: dict, subject: str = "revision", label=_revision_label) -> str:
    """An interleaved A/B (lab.ab_revisions): medians, and ratios to the first; each row
    named by `label(record, revision)` (the revision, or the index it served)."""
    levels = list(next(iter(record["summary"].values())))
    rows = [f"| {subject} ({record['rounds']} rounds, fresh Ray each) | " + " | ".join(
        f"{level} queries/s (vs first) | {level} CPU ms/req (vs first)" for level in levels) + " |",
        "|---" * (1 + 2 * len(levels)) + "|"]
    for revision, by_level in record["summary"].items():
        rows.append(f"| {label(record, revision)} | " + " | ".join(
            f"{_cell(v['queries_per_s'])} ({v['qps_vs_first']}) | {v['cpu_ms_per_request']:.3f} "
            f"({v['cpu_vs_first']})" for v in by_level.values()) + " |")
    return "\n".join(rows)


def idle_table(record: dict) -> str:
    """What each Serve system of `make bench` costs serving nothing (steady state, warm pool full)."""
    idle = record.get("idle_percent_of_a_core", {})
    systems = list(idle)
    left_out = ("warm_pool", SELF_CLASS)
    classes = sorted({c for values in idle.values() for c in values if c not in left_out})
    rows = ["| idle, % of a core | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for name in classes:
        rows.append(f"| {name} | " + " | ".join(_cell(idle[s].get(name)) for s in systems) + " |")
    rows.append("| total | " + " | ".join(
        _cell(round(sum(v for c, v in idle[s].items() if c not in left_out), 2)) for s in systems) + " |")
    if any(SELF_CLASS in idle[s] for s in systems):
        rows.append(f"| {SELF_CLASS} (not in total) | " + " | ".join(
            _cell(idle[s].get(SELF_CLASS)) for s in systems) + " |")
    rows.append("| idle workers in the warm pool | " + " | ".join(
        _cell(idle[s].get("warm_pool")) for s in systems) + " |")
    return "\n".join(rows)


# (record, what it served): the serving side of each committed `make bench` run, oldest first, from
# the revision it ran on. A median row per kind.
ROW_DEALT, LIST_DEALT = "index dealt by row, 2 batches", "index dealt by list, 2 batches"
ONE_BATCH = "index dealt by list, 1 batch per shard replica"
LARGE_OVERLAP = "index dealt by list, 1 batch per shard replica + 1 for >= 32 queued vectors"
BLAS_QUANTIZER = LARGE_OVERLAP + ", router quantizer on BLAS from 6 rows"
LIST_SCAN = BLAS_QUANTIZER + ", shards scan 64+ rows list by list"
# From here the c=32 / c=1 ratios are measured through the edge as `shardserve serve` runs it.
DEFAULT_SERVE = LIST_SCAN + "; ratios through the default edge, authenticated links, llhttp door"
CONTROL_LOOP = DEFAULT_SERVE + ", Serve's controller loop every 0.25 s"
HISTOGRAM_TOTALS = CONTROL_LOOP + "; histograms exported as totals, 1 warm worker (since reverted to 4)"
HISTOGRAM_TOTALS_4_WARM = CONTROL_LOOP + "; histograms exported as totals, 4 warm workers"
# From here the headline ratios are the `shardserve serve` command itself, alternating with uvicorn.
SERVE_COMMAND_ALTERNATING = HISTOGRAM_TOTALS_4_WARM + "; headline: the serve command, 2 alternating rounds"
EDGE_DELAY_RULE = SERVE_COMMAND_ALTERNATING + "; the edge's delay rule while shedding"
BENCH_RUNS = (("bench-run-1.json", ROW_DEALT), ("bench-run-2.json", ROW_DEALT),
              ("bench-run-3.json", ROW_DEALT), ("bench-run-4.json", ROW_DEALT),
              ("bench-run-5.json", ROW_DEALT), ("bench-run-6.json", ROW_DEALT),
              ("bench-run-7.json", LIST_DEALT), ("bench-run-8.json", LIST_DEALT),
              ("bench-run-9.json", LIST_DEALT), ("bench-run-10.json", ONE_BATCH),
              ("bench-run-11.json", ONE_BATCH), ("bench-run-12.json", ONE_BATCH),
              ("bench-run-13.json", LARGE_OVERLAP), ("bench-run-14.json", LARGE_OVERLAP),
              ("bench-run-15.json", BLAS_QUANTIZER), ("bench-run-16.json", BLAS_QUANTIZER),
              ("bench-run-17.json", LIST_SCAN), ("bench-run-18.json", LIST_SCAN),
              ("bench-run-19.json", DEFAULT_SERVE), ("bench-run-20.json", CONTROL_LOOP),
              ("bench-run-21.json", CONTROL_LOOP), ("bench-run-22.json", HISTOGRAM_TOTALS),
              ("bench-run-23.json", HISTOGRAM_TOTALS), ("bench-run-24.json", HISTOGRAM_TOTALS_4_WARM),
              ("bench-run-25.json", SERVE_COMMAND_ALTERNATING),
              ("bench-run-26.json", SERVE_COMMAND_ALTERNATING), ("bench.json", EDGE_DELAY_RULE))
RUN_RATIOS = ("qps_c32_vs_uvicorn", "cpu_per_request_c32_vs_uvicorn", "c1_p50_minus_compute_p50_ms",
              "c1_1shard_p50_minus_compute_p50_ms", "batch256_vs_inprocess_batched",
              "qps_c32_npy_vs_uvicorn_npy", "cpu_per_request_c32_npy_vs_uvicorn_npy",
              "batch256_npy_vs_inprocess_batched")  # the .npy ones: runs since bodies could be .npy


def bench_runs_table(runs: list[tuple[dict, str]]) -> str:
    """The #10 targets over the committed `make bench` runs (oldest first, each with what it
    served), and the median of each kind: one run's ratio moves by ~10% here (the baseline's own
    QPS moved as much between runs). A ratio added later shows "–" before it."""
    rows = ["| run | served | " + " | ".join(RUN_RATIOS) + " |", "|---" * (len(RUN_RATIOS) + 2) + "|"]
    for record, served in runs:
        label = f"`{record['name']}` {record['created_at'][:16]}, index `{record['index']['version']}`"
        rows.append(f"| {label} | {served} | " + " | ".join(
            str(record["ratios"][name]["value"]) if name in record["ratios"] else "–"
            for name in RUN_RATIOS) + " |")

    series = list(dict.fromkeys(served for _, served in runs))  # a new index or default: a new one

    def median(current: list[dict], name: str) -> str:
        values = [r["ratios"][name]["value"] for r in current if name in r["ratios"]]
        return str(round(statistics.median(values), 3)) if values else "–"

    for kind in series:
        current = [record for record, served in runs if served == kind]
        rows.append(f"| median of the {len(current)} run(s) | {kind} | "
                    + " | ".join(median(current, name) for name in RUN_RATIOS) + " |")
    targets = [runs[-1][0]["ratios"][name]["target"] for name in RUN_RATIOS]  # the newest has all
    rows.append("| target | | " + " | ".join(targets) + " |")
    return "\n".join(rows)


def blocks(records: Path = RECORDS) -> dict[str, str]:
    bench = json.loads((records / "bench.json").read_text())
    hop = json.loads((records / "hop.json").read_text())
    profile = json.loads((records / "profile-hot-path.json").read_text())
    admission = json.loads((records / "admission.json").read_text())
    soak = json.loads((records / "soak.json").read_text())
    bench_filter = json.loads((records / "bench-filter.json").read_text())
    autoscale = json.loads((records / "autoscale.json").read_text())
    spare_core = json.loads((records / "autoscale-spare-core.json").read_text())
    shard_start = json.loads((records / "shard-start.json").read_text())
    scan_cost = json.loads((records / "scan-cost.json").read_text())
    scale = json.loads((records / "bench-scale.json").read_text())
    hygiene = json.loads((records / "hygiene.json").read_text())
    glove = json.loads((records / "bench-glove.json").read_text())
    hot_path = json.loads((records / "hot-path-ab.json").read_text())
    partition_ab = json.loads((records / "partition-ab.json").read_text())
    batches = json.loads((records / "hot-path-batches.json").read_text())
    batches_ab = json.loads((records / "batches-ab.json").read_text())
    one_batch_ab = json.loads((records / "one-batch-ab.json").read_text())
    large_overlap_ab = json.loads((records / "large-overlap-ab.json").read_text())
    early_release_ab = json.loads((records / "early-release-ab.json").read_text())
    blas_rows = json.loads((records / "blas-rows.json").read_text())
    blas_rows_ab = json.loads((records / "blas-rows-ab.json").read_text())
    list_scan_ab = json.loads((records / "list-scan-ab.json").read_text())
    runs = [(json.loads((records / name).read_text()), served) for name, served in BENCH_RUNS
            if (records / name).exists()]
    return {"bench": bench_table(bench), "bench-cpu": cpu_table(bench),
            "bench-ratios": ratios_table(bench), "hop": hop_table(hop), "profile": profile_table(profile),
            "admission": admission_table(admission), "soak": soak_table(soak),
            "headline": headline_table(bench, admission),
            "bench-filter": filter_table(bench_filter),
            "autoscale": autoscale_table(autoscale),
            "autoscale-spare-core": autoscale_table(spare_core) + "\n\n" + burst_line(spare_core),
            "shard-start": shard_start_table(shard_start), "scan-cost": scan_cost_table(scan_cost),
            "bench-scale": bench_scale_table(scale), "hygiene": hygiene_table(hygiene),
            "bench-glove": glove_table(glove), "hot-path-ab": ab_table(hot_path),
            "hot-path-batches": ab_table(batches), "batches-ab": ab_table(batches_ab),
            "one-batch-ab": ab_table(one_batch_ab), "large-overlap-ab": ab_table(large_overlap_ab),
            "bench-runs": bench_runs_table(runs),
            "bench-idle": idle_table(bench),
            "early-release-ab": ab_table(early_release_ab), "blas-rows": blas_rows_table(blas_rows),
            "blas-rows-ab": ab_table(blas_rows_ab), "list-scan-ab": ab_table(list_scan_ab),
            "partition-ab": ab_table(partition_ab, "index served", _index_label)}


def _rss_growth(samples: list[dict], after_s: float = 60.0) -> tuple[str, float]:
    """The process class whose RSS grew most from the first sample after `after_s` to the last: its
    name and the growth in %."""
    kept = [sample for sample in samples if sample["t"] >= after_s] or samples
    first, last = kept[0], kept[-1]
    growth = {name: 100 * (last[name] - first[name]) / first[name]
              for name in first if name != "t" and name in last and first[name] >= 50}
    name = max(growth, key=lambda n: abs(growth[n]), default="–")
    return name, round(growth.get(name, 0.0), 1)


def soak_table(record: dict) -> str:
    """Each steady open-loop run of `loadtests.soak`: load, answers, latency, stalls, memory."""
    rows = ["| load (x 32-client capacity) | req/s | minutes | requests | answered 200 | other codes | "
            "worst minute p99 | max | seconds with a stall | RSS growth after 1 min (largest) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for run in record["runs"]:
        other = ", ".join(f"{code}: {n:,}" for code, n in sorted(run["status_codes"].items())
                          if code != "200")
        name, growth = _rss_growth(run["rss_mb"])
        rows.append(f"| {run['load_x_capacity']} (of {run['capacity_qps']:,.0f}) | {run['rate']:,} | "
                    f"{run['duration_s'] / 60:g} | {run['requests']:,} | {run['success_ratio']:.4%} | "
                    f"{other or 'none'} | {max(m['p99_ms'] for m in run['per_minute']):.1f} ms | "
                    f"{max(m['max_ms'] for m in run['per_minute']):.0f} ms | {len(run['stall_seconds'])} | "
                    f"{growth:+.1f} % ({name}) |")
    return "\n".join(rows)


def _replacer(table: str):
    return lambda m: m.group(1) + table + "\n" + m.group(2)


def render(page: str, generated: dict[str, str]) -> tuple[str, set[str]]:
    """The page with each of its generated blocks re-rendered, and the names it holds."""
    found = set()
    for name, table in generated.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- /generated:{name} -->)", re.S)
        if pattern.search(page):
            found.add(name)
            page = pattern.sub(_replacer(table), page)
    return page, found


def render_all(generated: dict[str, str]) -> dict[Path, tuple[str, str]]:
    """(current, wanted) text of every page; every block must sit in some page."""
    out: dict[Path, tuple[str, str]] = {}
    placed: set[str] = set()
    for path in pages():
        current = path.read_text()
        wanted, found = render(current, generated)
        out[path], placed = (current, wanted), placed | found
    if missing := set(generated) - placed:
        raise SystemExit(f"no page has a <!-- generated:NAME --> block for {sorted(missing)}")
    return out


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--check", action="store_true")
    args = cli.parse_args()
    stale = []
    for path, (current, wanted) in render_all(blocks()).items():
        if wanted != current:
            stale.append(path.name)
            if not args.check:
                path.write_text(wanted)
    if args.check and stale:
        print(f"{', '.join(stale)}: results differ from loadtests/records: "
              "run python -m loadtests.readme_tables", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
