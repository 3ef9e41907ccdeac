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
# The `make bench` ratios followed run by run (bench_runs_table): the headline, the `shardserve serve`
# command against uvicorn + FAISS in alternating rounds, and 256-query batches against FAISS in-process.
HEADLINE_RATIOS = ("qps_c32_vs_uvicorn", "cpu_per_request_c32_vs_uvicorn", "c1_p50_minus_uvicorn_c1_p50_ms")
BATCH_RATIOS = ("batch256_vs_inprocess_batched", "batch256_npy_vs_inprocess_batched")
LEDGER_RATIOS = HEADLINE_RATIOS + BATCH_RATIOS


def _cell(value: object) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return str(value)


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
    """The newest run's ratios but the ledger's (bench_runs_table shows those for every run)."""
    rows = ["| ratio (newest run) | value | target | met |", "|---|---|---|---|"]
    for name, check in record.get("ratios", {}).items():
        if name in LEDGER_RATIOS:
            continue
        rows.append(f"| {name} | {check['value']} | {check['target']} | {'yes' if check['met'] else 'no'} |")
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
    """Filtered search on the default `shardserve serve`, per selectivity, with the median time all
    shards took to choose the filter's rows (from posting lists, or a pass over the columns)."""
    base = record["levels"][0]["qps"]
    chosen = {c["filter_label"]: c for c in record.get("selection", [])}
    rows = ["| filter | matching rows | recall@10 (HTTP, vs brute force) | req/s at 32 clients (vs none) "
            "| p99 ms | 200 | choosing its rows, ms: posting lists / a pass over the columns |",
            "|---|---|---|---|---|---|---|"]
    for level in record["levels"]:
        ratio = _cell(round(level["qps"] / base, 3))
        choice = chosen.get(level["filter_label"], {})
        rows.append(f"| {level['filter_label']} | {_cell(level['matching_rows'])} | {_cell(level['recall'])} "
                    f"| {_cell(level['qps'])} ({ratio}) | {_cell(level['p99_ms'])} "
                    f"| {_cell(100 * level['success_ratio'])} % | {_cell(choice.get('ms_postings'))} / "
                    f"{_cell(choice.get('ms_scan'))} |")
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
    met = [name for name, ok in v["checks"].items() if ok]
    missed = [f"**{name}**" for name, ok in v["checks"].items() if not ok]
    rows += ["", f"Goals met: {', '.join(met) or 'none'}; missed: {', '.join(missed) or 'none'}. "
             f"Under overload the 200s' p99 was {_cell(v['admitted_p99_ms'])} ms against a bound of "
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


def scan_choice_table(records: list[dict]) -> str:
    """lab.scan_choice on each index: per batch size, list by list against query by query (CPU per
    query, mean over the shards), how often the batch reads each of its lists, what the rule picks."""
    rows = ["| index | list size | batch | list by list vs query by query (CPU) | reads per list | "
            "chosen |", "|---|---|---|---|---|---|"]
    for record in records:
        index = record["index"]
        by_batch: dict[int, list[dict]] = {}
        for row in record["scan_choice"]:
            by_batch.setdefault(row["batch"], []).append(row)
        for batch, shards in sorted(by_batch.items()):
            ratio = statistics.mean(r["by_list_vs_by_query"] for r in shards)
            reads = sum(r["pair_mb"] for r in shards) / sum(r["distinct_mb"] for r in shards)
            chosen = {r.get("chosen", "?") for r in shards}
            picked = "by list" if chosen == {"lists"} else "by query" if chosen == {"queries"} else "both"
            rows.append(f"| {index['vectors']:,} `{index['factory']}`, nprobe {index['params']['nprobe']} "
                        f"| {shards[0]['mean_list_kb']:,.0f} KB | {batch} | {ratio:.2f}× | {reads:.2f} | "
                        f"{picked} |")
    return "\n".join(rows)


def half_scan_table(record: dict) -> str:
    """lab.half_scan: per batch size, the half-precision copy's scan against the float32 one (CPU per
    query, mean over the shards), the rows its bound settled, and whether answers were FAISS's."""
    index = record["index"]
    rows = ["| index | batch | half-precision copy vs float32 lists (CPU) | rows settled by the bound | "
            "answers equal to FAISS's (ids; distances bit for bit) |", "|---|---|---|---|---|"]
    by_batch: dict[int, list[dict]] = {}
    for row in record["half_scan"]:
        by_batch.setdefault(row["batch"], []).append(row)
    for batch, shards in sorted(by_batch.items()):
        ratio = statistics.mean(r["half_vs_float32"] for r in shards)
        settled = min(r["settled"] for r in shards)
        same = min(r["same_ids_as_faiss"] for r in shards)
        bits = "yes" if all(r["distances_bit_equal"] for r in shards) else "no"
        low, high = (f(r["half_vs_float32"] for r in shards) for f in (min, max))
        rows.append(f"| {index['vectors']:,} `{index['factory']}`, nprobe {index['params']['nprobe']} "
                    f"| {batch} | {ratio:.2f}× ({low:.2f}–{high:.2f}) | {settled:.1%} | {same:.1%}; {bits} |")
    return "\n".join(rows)


def scale_served_table(record: dict) -> str:
    """loadtests.scale_served: the default `shardserve serve` against the monolith at millions of
    vectors, per client count; then the ratios and the burst."""
    summary, recall, index = record["summary"], record["recall"], record["index"]
    clients = sorted(int(key[1:]) for key in summary["shardserve"])
    rows = [f"{index['vectors']:,} × {record['dataset']['dim']}, `{index['factory']}`, "
            f"{index['shards']} shards, nprobe {index['params']['nprobe']}; {record['rounds']} rounds of "
            f"each side, alternating, {record['duration_s']:g} s a level. recall@10 over HTTP: "
            f"`shardserve serve` {recall['shardserve']['recall_at_k']:.4f}, monolith "
            f"{recall['monolith']['recall_at_k']:.4f}.", "",
            "| clients | `shardserve serve` q/s | monolith q/s | ratio | CPU ms/request: ours / monolith | "
            "ratio | p99 ms: ours / monolith |", "|---|---|---|---|---|---|---|"]
    for c in clients:
        ours, theirs = summary["shardserve"][f"c{c}"], summary["monolith"][f"c{c}"]
        ratios = summary["ratios"]
        rows.append(f"| {c} | {ours['qps']:,.0f} | {theirs['qps']:,.0f} | "
                    f"{ratios[f'qps_c{c}_vs_monolith']:.2f}× | "
                    f"{ours['cpu_ms_per_request']:.2f} / {theirs['cpu_ms_per_request']:.2f} | "
                    f"{ratios[f'cpu_per_request_c{c}_vs_monolith']:.2f}× | "
                    f"{ours['p99_ms']:.1f} / {theirs['p99_ms']:.1f} |")
    per_round = {c: [round(lv["qps"] / other["qps"], 2) for lv, other in zip(
        [lv for lv in record["levels"] if lv["label"].startswith("shardserve-") and lv["value"] == c],
        [lv for lv in record["levels"] if lv["label"].startswith("monolith-") and lv["value"] == c],
        strict=True)] for c in clients}
    rows += ["", "Each round's queries/s ratio: " + "; ".join(
        f"{c} clients {', '.join(f'{r:.2f}×' for r in ratios)}" for c, ratios in per_round.items()) + "."]
    for b in record.get("bursts", []):
        codes = ", ".join(f"{code}: {n:,}" for code, n in sorted(b["status_codes"].items()))
        worst = max((s["p99_ms_by_status"].get("200", 0.0) for s in b["per_second"]), default=0.0)
        refused = "" if b.get("p99_ms_503") is None else f"; its 503s in p99 {b['p99_ms_503']} ms"
        side = b["label"].rsplit("-", 1)[0]
        sent = b["requests"] / b["seconds"]
        short = "" if sent >= 0.95 * b["rate"] else (" (the load generator's workers, all waiting, sent "
                                                      "no more)")
        answered = b["status_codes"].get("200", 0) / b["seconds"]
        rows += ["", f"Burst, {side}: {b['rate']:,} req/s open loop for {b['seconds']:g} s, "
                     f"{sent:,.0f} req/s sent{short}: {codes}, {answered:,.0f} answered a second; "
                     f"answered p50 {b['p50_ms_200']} ms, p99 {b['p99_ms_200']} ms (worst "
                     f"second {worst:,.0f} ms){refused}."]
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


def idle_table(record: dict) -> str:
    """What each Serve system of `make bench` costs serving nothing (steady state, warm pool full)."""
    idle = record.get("idle_percent_of_a_core", {})
    systems = list(idle)
    left_out = ("warm_pool", SELF_CLASS)
    classes = sorted({c for values in idle.values() for c in values if c not in left_out})
    totals = {s: round(sum(v for c, v in idle[s].items() if c not in left_out), 2) for s in systems}
    rates = {s: next((lv["qps"] for lv in record["levels"] if lv["label"] == s and lv["value"] == 32), None)
             for s in systems}
    rows = ["| idle, % of a core | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for name in classes:
        rows.append(f"| {name} | " + " | ".join(_cell(idle[s].get(name)) for s in systems) + " |")
    rows.append("| total | " + " | ".join(_cell(totals[s]) for s in systems) + " |")
    # % of a core is 10 x that many ms of CPU per second: spread over the 32-client level's requests
    rows.append("| total, in ms per request at its 32-client rate | " + " | ".join(
        f"{totals[s] * 10 / rates[s]:.3f}" if rates[s] else "–" for s in systems) + " |")
    if any(SELF_CLASS in idle[s] for s in systems):
        rows.append(f"| {SELF_CLASS} (not in total) | " + " | ".join(
            _cell(idle[s].get(SELF_CLASS)) for s in systems) + " |")
    rows.append("| idle workers in the warm pool | " + " | ".join(
        _cell(idle[s].get("warm_pool")) for s in systems) + " |")
    return "\n".join(rows)


def bench_runs(records: Path = RECORDS) -> list[tuple[str, dict]]:
    """(file name, record) of every committed `make bench` run whose headline is the `shardserve
    serve` command alternating with uvicorn (the records with a `headline`): bench.json and the runs
    kept beside it as bench-run-N.json, oldest first; a copy of a run counts once. Earlier runs
    measured the headline another way and are in git's history only (docs/experiments.md)."""
    runs: dict[str, tuple[str, dict]] = {}
    for path in [*sorted(records.glob("bench-run-*.json")), records / "bench.json"]:
        record = json.loads(path.read_text())
        if "headline" in record:
            runs.setdefault(record["created_at"], (path.name, record))
    return [runs[at] for at in sorted(runs)]


def bench_runs_table(runs: list[tuple[str, dict]]) -> str:
    """The ledger: per run, the headline ratios (each round's in brackets) and the 256-query batch's,
    then the median of the runs and the targets as the newest run states them."""
    def headline(record: dict, name: str) -> str:
        rounds = ", ".join(str(r[name]) for r in record["headline"]["per_round"])
        return f"{record['ratios'][name]['value']} ({rounds})"

    def median(name: str) -> str:
        values = [record["ratios"][name]["value"] for _, record in runs if name in record["ratios"]]
        return str(round(statistics.median(values), 3)) if values else "–"

    rows = ["| run | index | req/s at 32 clients: `shardserve serve` / uvicorn | queries/s vs uvicorn "
            "(rounds) | CPU per request vs uvicorn (rounds) | one client's p50 minus uvicorn's, ms "
            "(rounds) | 256-query batch vs in-process FAISS: JSON / .npy |", "|---|---|---|---|---|---|---|"]
    for name, record in runs:
        served, uvicorn = record["headline"]["headline-served"], record["headline"]["headline-uvicorn"]
        batches = " / ".join(_cell(record["ratios"].get(n, {}).get("value")) for n in BATCH_RATIOS)
        rows.append(f"| `{name}` {record['created_at'][:16]} | `{record['index']['version']}` | "
                    f"{_cell(served['qps_c32'])} / {_cell(uvicorn['qps_c32'])} | "
                    + " | ".join(headline(record, n) for n in HEADLINE_RATIOS) + f" | {batches} |")
    rows.append(f"| median of the {len(runs)} runs | | | " + " | ".join(median(n) for n in HEADLINE_RATIOS)
                + " | " + " / ".join(median(n) for n in BATCH_RATIOS) + " |")
    targets = runs[-1][1]["ratios"]
    rows.append("| target | | | " + " | ".join(targets[n]["target"] for n in HEADLINE_RATIOS) + " | "
                + " / ".join(targets[n]["target"] for n in BATCH_RATIOS) + " |")
    return "\n".join(rows)


def link_mac_line(record: dict) -> str:
    """What the shard links' MAC adds to sealing and opening one frame (lab.link_mac)."""
    frames = [f"a {f['bytes']:,}-byte {kind} frame {_cell(f['us_with_mac'])} µs with the MAC, "
              f"{_cell(f['us_without_mac'])} µs without" for kind, f in record["frames"].items()]
    return (f"Seal and open, one thread, best of {record['rounds']} rounds of {record['number']:,}: "
            + "; ".join(frames) + ".")


def _outcomes(measure: dict) -> str:
    """"60 of 60: 200, deleted 2" for each outcome of a measure's requests."""
    return "; ".join(f"{n} of {measure['deletes']}: {outcome}" for outcome, n in measure["outcomes"].items())


def writes_table(crash: dict, bench: dict, compaction: dict, backpressure: dict | None = None) -> str:
    """Online writes: what SIGKILLs left of acknowledged writes, read-your-writes, compaction under
    load (loadtests.crash_writes, .compact_under_load), then the write rates beside the peer's and
    searches while ingesting (loadtests.bench_writes)."""
    kinds = ", ".join(sorted({event["kind"] for event in crash["kills"]}))
    seen, searches, upserts = crash["read_your_writes"], compaction["searches"], compaction["upserts"]
    rows = ["| check | result |", "|---|---|",
            f"| SIGKILLs under single writes from {crash.get('writers', 1)} writer"
            f"{'s at once' if crash.get('writers', 1) > 1 else ''} ({kinds}; {len(crash['kills'])} in all"
            + (f"; the server compacting by itself: {crash['compactions_started']} compactions started, "
               f"{crash['swaps']} swapped in" if "swaps" in crash else "") + ") | "
            f"acknowledged upserts found: {crash['upserts_checked'] - len(crash['upserts_lost']):,} of "
            f"{crash['upserts_checked']:,}; acknowledged deletes back: {len(crash['deletes_returned'])} of "
            f"{crash['deletes_checked']:,} |",
            *([f"| deletes by filter through the kills (each of two upserts tagged for it) | acknowledged: "
               f"{fd['acked']}; deleted exactly their tagged points: {fd['deleted_exactly_the_tagged']} "
               f"of the {fd['all_tagged_acknowledged']} whose two upserts were acknowledged; others: "
               f"{fd['outside_the_tagged']} |"] if (fd := crash.get("filter_deletes")) else []),
            f"| read-your-writes through the kills | upserts found at once: {seen['upserts_found']:,} of "
            f"{seen['upserts_found'] + seen['upserts_missed']:,}; deletes absent at once: "
            f"{seen['deletes_absent']:,} of {seen['deletes_absent'] + seen['deletes_found']:,} |",
            f"| compact + swap under {compaction['searches_per_s']:g} searches/s and "
            f"{compaction['upserts_per_s']:g} upserts/s | searches answered 200: "
            f"{searches['success_ratio']:.2%} (p99 {searches['p99_ms']:.0f} ms); upserts by status: "
            f"{upserts['statuses']}; acknowledged upserts lost: {len(upserts['lost'])} of "
            f"{upserts['acked']:,} |"]
    if "memory" in compaction:  # older records did not sample it
        memory, moments = compaction["memory"], ("before_writes", "writes_peak", "after_last_swap")
        sizes = [f"{name}: " + " / ".join(f"{memory[when][name]['largest_anon_mb']:.0f}" for when in moments)
                 + f" MB ({compaction['memory_after_vs_before'][name]:.2f}x)"
                 for name in ("router", "shards")]
        rows.append("| resident memory (anon) of the largest router / shard replica: before the writes, "
                    f"at their peak, after the last compaction's swap | {'; '.join(sizes)} |")
    if backpressure is not None:
        rows += backpressure_rows(backpressure)
    s, c, ratio = bench["results"]["shardserve"], bench["results"]["chroma"], bench["ratios"]
    one, peer_one = s["single_8_clients"], c["single_8_clients"]
    search = s["search_32_clients"]
    rows += ["", "| writes, one run | shardserve | Chroma's server | ratio |", "|---|---|---|---|",
             f"| batches of 100 upserts, vectors/s | {s['batch_100']['vectors_per_s']:,.0f} | "
             f"{c['batch_100']['vectors_per_s']:,.0f} | {ratio['batch_100_vectors_per_s']:.2f}x |",
             *([f"| the same as .npy bodies (ids, then vectors), vectors/s | "
                f"{s['batch_100_npy']['vectors_per_s']:,.0f} | (JSON only) | "
                f"{s['batch_100_npy']['vectors_per_s'] / c['batch_100']['vectors_per_s']:.2f}x |"]
               if "batch_100_npy" in s else []),
             f"| single upserts, 8 clients, /s | {one['upserts_per_s']:,.0f} | "
             f"{peer_one['upserts_per_s']:,.0f} | {ratio['single_upserts_per_s']:.2f}x |",
             f"| acknowledgement p50 / p99 | {one['p50_ms']} / {one['p99_ms']} ms | "
             f"{peer_one['p50_ms']} / {peer_one['p99_ms']} ms | p99 {ratio['single_ack_p99']:.2f}x |",
             f"| deletes, batches of 100, ids/s | {s['deletes_per_s']:,.0f} | {c['deletes_per_s']:,.0f} | "
             f"{ratio['deletes_per_s']:.2f}x |",
             f"| upserts found right after their 200 | {s['upserts_found_at_once']} of {s['upserts']} | "
             f"{c['upserts_found_at_once']} of {c['upserts']} | |",
             f"| deleted ids absent right after | {s['deleted_absent']} of {s['deletes']} | "
             f"{c['deleted_absent']} of {c['deletes']} | |",
             f"| searches/s at 32 clients, quiet / with {_ingest_rate(search):,.0f} single upserts/s"
             + (f" (the median of {len(search['pairs'])} pairs of windows: "
                + ", ".join(f"{r:.2f}" for r in search["pairs"]) + ")" if "pairs" in search else "")
             + f" | {search['quiet']['qps']:,.0f} / {search['ingesting']['qps']:,.0f} | | "
             f"{search['qps_ratio']:.2f}x |",
             *([f"| deletes by filter beside {fd['ingest']['qps']:,.0f} single upserts/s, each of two "
                f"points tagged for it | {_outcomes(fd)}; p50 / p99 {fd['p50_ms']:.0f} / "
                f"{fd['p99_ms']:.0f} ms | | |"]
               if (fd := s.get("filter_deletes_under_ingest")) else [])]
    if "churn" in s:
        churn, recall = s["churn"], s["churn"]["recall_at_10"]
        rows += [f"| recall@10 after {churn['deleted']:,} deletes and {churn['added']:,} new rows "
                 f"(nprobe {churn['nprobe']}), exact ground truth over the live rows | "
                 f"{recall['served_after_churn']:.4f} | a fresh index on the live rows: "
                 f"{recall['fresh_index_on_live_rows']:.4f} | {churn['after_minus_fresh']:+.4f} |"]
    return "\n".join(rows)


def backpressure_rows(record: dict) -> list[str]:
    """Upserts past the backlog bound (loadtests.write_backpressure): what was taken, how fast the
    rest was refused, searches' p99 by phase, the shards' memory at the bound."""
    refused, searches, writers = record["refused_503"], record["searches"], record["writers"]
    p99 = " / ".join(f"{searches[phase]['worst_p99_ms']:.0f}" for phase in
                     ("quiet", "filling", "refusing", "compact_and_swap", "after"))
    memory = record["memory"]
    return [f"| {writers['clients']} clients sending batches of 100 upserts past the backlog bound "
            f"({record['bound_upserts']:,}) | acknowledged: {record['upserts_acknowledged']:,}; then "
            f"{refused['count']:,} 503s (p50 {refused['p50_ms']:.0f} ms, p99 {refused['p99_ms']:.0f} ms, "
            f"Retry-After {', '.join(refused['retry_after'])} s); other statuses: "
            f"{record['other_statuses'] or 'none'}; after compaction and swap, an upsert: "
            f"{record['upsert_after_swap_status']}; acknowledged upserts sampled lost: "
            f"{record['acknowledged_sampled_lost']} of {record['acknowledged_sampled']} |",
            f"| searches beside them ({record['searches_per_s']:g}/s): worst 5 s p99, quiet / filling / "
            f"refusing / compact and swap / after | {p99} ms, all "
            f"{'200' if all(set(p['status_codes']) == {'200'} for p in searches.values()) else 'NOT 200'} |",
            "| largest shard replica's memory (anon): before / at the bound / after the swap | "
            + " / ".join(f"{memory[when]['shards']['largest_anon_mb']:.0f}" for when in
                         ("before", "full", "after_swap")) + " MB |"]


def head_loss_table(record: dict) -> str:
    """The head node SIGKILLed and restarted under load, with the GCS in Redis and without."""
    rows = ["| run | requests | answered 200 | lost | apps RUNNING after the restart | replicas "
            "restarted | pointer kept | swap after |", "|---|---|---|---|---|---|---|---|"]
    for name, label in (("with_store", "GCS in Redis"), ("control", "no store (control)")):
        r = record[name]
        running = "never (within the wait)" if r["recovered_s"] is None else f"{r['recovered_s']} s"
        rows.append(f"| {label} | {r['requests']} | {r['answered_200']} ({100 * r['answered_ratio']:.2f} %)"
                    f" | {r['lost']} | {running} | {r['replicas_restarted']} | "
                    f"{'yes' if r['pointer_ok'] else 'no'} | {'yes' if r['swap_after_ok'] else 'no'} |")
    written = record["with_store"].get("writes")
    if written:
        rows += ["", f"Single writes beside the searches, their log a stream in the same Redis: "
                     f"{written['upserts_acked']} upserts and {written['deletes_acked']} deletes "
                     f"acknowledged across the head's loss; after it, acknowledged upserts not found: "
                     f"{written['upserts_lost']}, acknowledged deletes back: {written['deletes_returned']}; "
                     f"a search right after each upsert's 200 missed it {written['missed_at_once']} times."]
    collection, chroma = (record["with_store"].get(key) for key in ("collection_writes", "chroma_adds"))
    if collection and chroma:
        rows += ["", f"Beside them, into a collection: {collection['upserts_acked']} upserts and "
                     f"{collection['deletes_acked']} deletes acknowledged, {collection['upserts_lost']} "
                     f"upserts not found after, {collection['deletes_returned']} deletes back; through "
                     f"Chroma's API, {chroma['adds_acked']} adds acknowledged, {chroma['adds_lost']} not "
                     "found after."]
    lost = record["with_store"].get("worker_loss")
    if lost:
        on_it = ", ".join(lost["deployments_on_killed_worker"])
        others = ", ".join(f"{n} answered {code}" for code, n in sorted(lost["status_codes"].items())
                           if code not in ("200", "0"))
        rows += ["", f"Then worker 2 ({on_it}) SIGKILLed under the same load: {lost['answered_200']} of "
                     f"{lost['requests']} answered 200{', ' + others if others else ''}, {lost['lost']} "
                     "lost (in flight on its router), "
                     f"{lost['partial_answers']} answers partial while its shards moved; its shards "
                     f"running on worker 1 again: {'yes' if lost['shards_placed_again'] else 'no'}."]
    return "\n".join(rows)


def log_latency_line(record: dict) -> str:
    """The write log's acknowledgement latency on both engines, one run (lab.write_log)."""
    sqlite, redis = record["levels"], record["redis"]["levels"]
    cells = [f"batches of {s['batch']}: {s['p50_ms']} / {s['p99_ms']} ms on SQLite, {r['p50_ms']} / "
             f"{r['p99_ms']} ms on Redis" for s, r in zip(sqlite, redis, strict=True)]
    return ("Acknowledgement latency, p50 / p99, in-process, one thread, side by side in one run "
            f"(`python -m lab.write_log`, on a {record['filesystem']} virtual disk whose flush may stop "
            "at the host's cache; Redis on loopback): " + "; ".join(cells) + ".")


def _ingest_rate(search: dict) -> float:
    """The upserts/s achieved beside the searches (older records: `ingest_per_s`)."""
    return search["ingest"]["qps"] if "ingest" in search else search["ingest_per_s"]


def text_bench_table(record: dict) -> str:
    """make bench-text: shardserve serve beside the text monolith, the issue's ratios, every figure
    from the record (its rounds pooled)."""
    head, base = record["headline"], record["baselines"]["in_process"]
    rows = ["| level | side | requests/s | p50 ms | p99 ms | server CPU ms / request |",
            "|---|---|---|---|---|---|"]
    names = {"unique_c32": "unique texts, 32 clients", "unique_c1": "unique texts, 1 client",
             "zipf_c32": "Zipf mix, 32 clients"}
    for level, label in names.items():
        for side, levels in head.items():
            if level in levels:
                lv = levels[level]
                rows.append(f"| {label} | {side} | {_cell(lv['qps'])} | {_cell(lv['p50_ms'])} | "
                            f"{_cell(lv['p99_ms'])} | {_cell(lv['cpu_ms_per_request'])} |")
    rows += ["", "| ratio | measured | target | met |", "|---|---|---|---|"]
    for name, ratio in record["ratios"].items():
        rows.append(f"| {name.replace('_', ' ')} | {_cell(ratio['value'])} | {ratio['target']} | "
                    f"{'yes' if ratio['met'] else '**no**'} |")
    rows += ["", f"The model alone, in-process on one thread: {_cell(base['embed_ms_per_text_alone'])} ms a "
                 f"text one at a time, {_cell(base['embed_ms_per_text_batched16'])} ms in batches of 16; a "
                 f"search {_cell(base['search_ms_per_query'])} ms. {record['rounds']} rounds, "
                 f"{record['corpus']['docs']:,} fortunes indexed."]
    return "\n".join(rows)


def text_autoscale_table(record: dict) -> str:
    """make bench-autoscale-text: a text ramp past the embedder's knee beside a light vector load;
    per step its texts, the vector searches beside them, and the embedder's replicas (most RUNNING
    while the step ran)."""
    rows = ["| text step | texts/s offered | answered/s | 503/s | answered p99 ms | 503 p99 ms | vector p99 "
            f"ms (quiet: {_cell(record['baseline']['vector']['p99_ms'])}) | embedder replicas |",
            "|---|---|---|---|---|---|---|---|"]
    for step in record["steps"]:
        text, vector = step["text"], step["vector"]
        seen = [sample["replicas"].get("Embedder", 0) for sample in record["replicas"]
                if step["started_at"] <= sample["t"] <= step["ended_at"]]
        rows.append(f"| {step['kind']} {step['rate']:g}/s | {_cell(text['offered_per_s'])} | "
                    f"{_cell(text['ok_per_s'])} | {_cell(text['shed_per_s'])} | {_cell(text['ok_p99_ms'])} | "
                    f"{_cell(text['shed_p99_ms'])} | {_cell(vector['p99_ms'])} | {max(seen, default=0)} |")
    rows += ["", "| check | met |", "|---|---|"]
    for name, check in record["checks"].items():
        if isinstance(check, dict):
            met = "yes" if check["met"] else "**no**"
            rows.append(f"| {name.split('_', 1)[1].replace('_', ' ')} | {met} |")
    return "\n".join(rows)


def blocks(records: Path = RECORDS) -> dict[str, str]:
    def load(name: str) -> dict:
        return json.loads((records / name).read_text())

    bench, admission = load("bench.json"), load("admission.json")
    spare_core = load("autoscale-spare-core.json")
    return {"headline": headline_table(bench, admission),
            "bench-runs": bench_runs_table(bench_runs(records)), "bench-cpu": cpu_table(bench),
            "bench-idle": idle_table(bench), "bench-ratios": ratios_table(bench),
            "link-mac": link_mac_line(load("link-mac.json")), "admission": admission_table(admission),
            "soak": soak_table(load("soak.json")),
            "writes": writes_table(load("crash-writes.json"), load("bench-writes.json"),
                                   load("compact-under-load.json"), load("write-backpressure.json")),
            "bench-filter": filter_table(load("bench-filter.json")),
            "head-loss": head_loss_table(load("head-loss.json")),
            "log-latency": log_latency_line(load("writes-log-latency.json")),
            "bench-scale": bench_scale_table(load("bench-scale.json")),
            "scan-choice": scan_choice_table([load("scan-choice-60k.json"), load("scan-choice-4m.json")]),
            "half-scan": half_scan_table(load("half-scan-4m.json")),
            "scale-served": scale_served_table(load("bench-scale-served.json")),
            "bench-glove": glove_table(load("bench-glove.json")),
            "shard-start": shard_start_table(load("shard-start.json")),
            "autoscale": autoscale_table(load("autoscale.json")),
            "autoscale-spare-core": autoscale_table(spare_core) + "\n\n" + burst_line(spare_core),
            "text-bench": text_bench_table(load("bench-text.json")),
            "text-autoscale": text_autoscale_table(load("autoscale-text.json")),
            "bench-tracing": tracing_table(load("bench-tracing.json")),
            "bench-collections": collections_table(load("bench-collections.json")),
            "grow-under-load": grow_table(load("grow-under-load.json")),
            "collections-isolation": isolation_table(load("collections-isolation.json")),
            "chroma-suite": chroma_suite_table(load("chroma-suite.json")),
            "bench-chroma": bench_chroma_table(load("bench-chroma.json"))}


def bench_chroma_table(record: dict) -> str:
    """`make bench-chroma`: one chromadb.HttpClient script against Chroma's server and shardserve."""
    rows = ["| server | load 60K s | filtered queries / s (p50, p99 ms) | adds of 10 / s (p50, p99 ms) |",
            "|---|---|---|---|"]
    for name in ("chroma", "shardserve"):
        run = record[name]
        query, add = run["query"], run["add"]
        rows.append(f"| {name} | {run['load_s']:g} | {query['per_s']:g} ({query['p50_ms']:g}, "
                    f"{query['p99_ms']:g}) | {add['per_s']:g} ({add['p50_ms']:g}, {add['p99_ms']:g}) |")
    same, ratios = record["identical_ids"], record["ratios"]
    rows += ["", f"Identical ids for {same['identical']:,} of {same['queries']:,} filtered queries "
                 "(n_results 10). "
                 f"shardserve / Chroma: queries {ratios['query']:g}x (target 2x: "
                 f"{'met' if ratios['query'] >= 2 else '**not met**'}), adds {ratios['add']:g}x (target 2x: "
                 f"{'met' if ratios['add'] >= 2 else '**not met**'}), load {ratios['load']:g}x faster. "
                 f"{record['clients']} clients, {record['seconds']:g} s each; both as exact as Chroma's API "
                 "makes them: Chroma's HNSW at ef_search 1,000, shardserve's collection flat (`"
                 + " ".join(record["shardserve_flags"]) + "`)."]
    return "\n".join(rows)


def chroma_suite_table(record: dict) -> str:
    """`make test-chroma`: Chroma's own tests against `shardserve serve`."""
    rows = ["| run | server flags | passed | failed | skipped by the wheel | folds while tested | of them "
            "grown into 2 shards | s |", "|---|---|---|---|---|---|---|---|"]
    for name, run in record["runs"].items():
        flags = " ".join(run["server_flags"][2:]) or "(as users run it)"
        rows.append(f"| {name} | `{flags}` | {run['passed']} | {len(run['failed'])} | "
                    f"{sum(run['skipped'].values())} | {_cell(run.get('folds'))} | "
                    f"{_cell(run.get('grown'))} | {run['seconds']:g} |")
    killed = record["killed"]
    seed = record.get("seed", "–")
    rows += ["", f"`chromadb` {record['chromadb']}, preset `{record['preset']}`, seed {seed}. "
                 f"SIGKILL of every process ({killed['processes_killed']}) under Chroma's client after "
                 f"{killed['acknowledged_records']:,} acknowledged records: after the restart, "
                 f"{'every one found whole' if killed['all_found'] else '**not all found**'} "
                 f"({killed['said']}). Not run: "
                 + "; ".join(f"`{test}` ({why})" for test, why in record["deselected"].items()) + "."]
    return "\n".join(rows)


def _checks_rows(record: dict) -> list[str]:
    """A record's checks (`ratios`: value, target, met) as a table, after a blank line."""
    return ["", "| check | measured | target | met |", "|---|---|---|---|",
            *(f"| {name.replace('_', ' ')} | {round(check['value'], 4)} | {check['target']} | "
              f"{'yes' if check['met'] else '**no**'} |" for name, check in record["ratios"].items())]


def isolation_table(record: dict) -> str:
    """`make bench-isolation`: one collection flooded beside another."""
    index, load = record["index"], record["load"]
    rows = ["| level | offered / s | requests | 200 | 503 | p99 of 200s ms | p99 of 503s ms |",
            "|---|---|---|---|---|---|---|"]
    for level in record["levels"]:
        codes, by_status = level["status_codes"], level.get("p99_ms_by_status") or {}
        rows.append(f"| {level['label']} | {_cell(level['value'])} | {level['requests']:,} | "
                    f"{codes.get('200', 0):,} | {codes.get('503', 0):,} | {_cell(by_status.get('200'))} | "
                    f"{_cell(by_status.get('503'))} |")
    rows += _checks_rows(record)
    rows += ["", f"{index['dataset']} ({index['dim']} dims): {index['small']:,} points searched at "
                 f"{load['rate']:g}/s beside {index['large']:,} searched at {load['flood']:g}/s, both exact, "
                 f"{load['duration_s']:g} s a level."]
    return "\n".join(rows)


def grow_table(record: dict) -> str:
    """`make bench-grow`: a collection crossing its growth threshold under load."""
    index, load, head = record["index"], record["load"], record["headline"]
    rows = ["| 10 s segment | stage at start → end | points acknowledged | searches | 200 | 503 | p99 ms |",
            "|---|---|---|---|---|---|---|"]
    for n, level in enumerate(record["levels"]):
        codes = level["status_codes"]
        rows.append(f"| {n} | {level['stage_at_start']} → {level['stage_at_end']} | "
                    f"{level['points_acknowledged']:,} | {level['requests']:,} | {codes.get('200', 0):,} | "
                    f"{codes.get('503', 0):,} | {_cell(level['p99_ms'])} |")
    rows += _checks_rows(record)
    rows += ["", f"{index['dataset']} ({index['dim']} dims), `{index['index']}` in {index['shards']} shards "
                 f"past {index['grow_at']:,} points, {index['prefill']:,} before the load; "
                 f"{load['search_rate']:g} searches/s and {load['write_rate']:g} upserts/s for "
                 f"{load['duration_s']:g} s. Built {head['built_s_into_load']} s into the load as "
                 f"{head['built_as']} ({head['search_params']}); {head['writes_acknowledged']:,} writes "
                 f"acknowledged, {head['writes_failed']} failed."]
    return "\n".join(rows)


def collections_table(record: dict) -> str:
    """`make bench-collections`: many small collections on one `shardserve serve`."""
    index = record["index"]
    rows = ["| round | collections | server processes before / after | router RSS MB before / after | "
            "KB per collection | s to create and fill one | p99 only it | p99 among all |",
            "|---|---|---|---|---|---|---|---|"]
    levels = {level["label"]: level for level in record["levels"]}
    for r in record["rounds"]:
        n = r["round"]
        only, every = levels[f"only-{n}"]["p99_ms"], levels[f"all-{n}"]["p99_ms"]
        rows.append(f"| {n} | {r['collections']:,} | {r['processes_before']} / {r['processes_after']} | "
                    f"{r['router_rss_mb_before']} / {r['router_rss_mb_after']} | "
                    f"{r['router_kb_per_collection']} | {r['create_and_fill_s_per_collection']} | "
                    f"{only:.2f} ms | {every:.2f} ms |")
    check = record["ratios"]["p99_all_vs_only"]
    met = "met" if check["met"] else "missed"
    rows += ["", f"{index['collections']:,} collections of {index['points']:,} points of {index['dim']} "
                 f"dims, searched exactly, {record['headline']['rate']:g} searches/s on one: p99 among all "
                 f"/ p99 with only it = {check['value']} (target {check['target']}: {met})."]
    return "\n".join(rows)


def tracing_table(record: dict) -> str:
    """`make bench` (f): `shardserve serve` with tracing off, on with sampling off, and 1 % traced."""
    rows = ["| `shardserve serve` | rounds | req/s at 32 clients | CPU ms per request | p99 |",
            "|---|---|---|---|---|"]
    names = {"tracing-off": "no trace endpoint (default)", "tracing-ratio0": "endpoint, ratio 0",
             "tracing-1pct": "endpoint, 1 % traced to Jaeger"}
    for side, row in record["headline"].items():
        rows.append(f"| {names.get(side, side)} | {row['rounds']} | {row['qps_c32']:,.1f} | "
                    f"{row['cpu_ms_per_request_c32']:.3f} | {row['p99_ms_c32']:.2f} ms |")
    rows += ["", "| ratio | value | target | met |", "|---|---|---|---|"]
    rows += [f"| {name} | {check['value']} | {check['target']} | {'yes' if check['met'] else 'no'} |"
             for name, check in record["ratios"].items()]
    return "\n".join(rows)


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
