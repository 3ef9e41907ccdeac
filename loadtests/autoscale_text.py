"""Text autoscaling ramp on the default `shardserve serve`: does the embedder scale (and only the
embedder), is overload past it refused fast, and do vector searches beside it keep their latency?

    python -m loadtests.autoscale_text [--index DIR] [--step-s 20] [--out loadtests/records]

Starts `shardserve serve INDEX` as a user starts it (its own local Ray, the edge with its default
admission, on a free port; the command at nice --server-nice, vegeta at 0, as loadtests/shedding.py
does on shared cores), joins that Ray (the address its banner prints) to read, every second, the
RUNNING replicas of the Embedder, of every shard deployment and of the router (Serve's status;
loadtests.during.ReplicaWatcher), and at the end the knee policy's crossings
(deployments.autoscaling.knee_events). Without --index it builds one first, as a user does:
the first --docs (8,000) Debian fortunes, `shardserve build --text-column text --embedder
all-MiniLM-L6-v2 --shards 2 --index Flat` (loadtests.bench_text.build_text_index).

The load, open loop (vegeta), after a short unrecorded warm-up:
- vectors: --vector-rate (20) searches/s of real embeddings of fortunes (computed in this process
  with shardserve.embed.model.Embedder before the server starts), ONE vegeta from the first step to
  the last, so it runs beside every text step; its first step alone is the quiet baseline;
- texts: steps of --step-s seconds at --rates (10, 30, 60, 100 /s), each started on schedule beside
  the previous one's last answers, then one at 2x the highest rate of 200s any step got (past
  capacity), started once the last ramp step has answered (a gap of its tail, a second or two, before
  it: its rate needs that step's figures). Every text is sent once (fortunes not in the index,
  then numbered variants "<n>. <fortune>": loadtests.bench_text.unique_stream), so the router's
  embedding cache never answers one: each costs a model run.

Per step: text offered rate, 200s/s, 503s/s (by who refused, from the body: the edge at once (its
text queue full) or after its queue timeout (same body, told apart by the latency), the router's
text admission, the embedder's timeout), p50/p99 of the 200s, p50/p99 of the 503s, other statuses;
vectors: rate, p50/p99, errors. The checks, from the data (CHECKS states the bounds):
(a) the Embedder's RUNNING replicas rose during the ramp while no shard deployment's changed;
(b) past capacity (every step that refused or answered < 95 % of its offer, and the 2x step) the
    503s' p99 is under CHECKS["shed_p99_ms"], and the 200s' p99 within CHECKS["admitted_p99_x_knee"]
    x the knee step's 200 p99 (the highest step that answered >= 95 % with no 503), at least
    CHECKS["admitted_p99_floor_ms"] (the bound loadtests/shedding.py holds vector overload to);
(c) in every text step, the vectors' p99 within CHECKS["vector_p99_x_baseline"] x the baseline's.
Then Ctrl-C (SIGINT) to the server, timed (loadtests.shedding.ctrl_c). Record: <out>/autoscale-text.json
and .png (offered/answered/refused text rates, latencies, replicas over time).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from loadtests.autoscale import per_second_of
from loadtests.record import RECORDS, header, save
from loadtests.report import parse_timestamp
from loadtests.vegeta_run import attack, attack_flags, decode, make_targets, vegeta, write_targets

SEED = 20_260
SERVER_NICE = 10  # as loadtests/shedding.py (see SERVER_NICE there): vegeta at 0 reads its answers in time
VEGETA_TIMEOUT_S = 15.0  # past the router's embed_timeout_s (10 s): the server's 503 comes first
VECTOR_TEXTS = 500  # distinct vectors of the vector load (fortunes not in the index, not sent as text)
WARM_TEXTS = 60
WARM_RATE, WARM_S = 10, 3.0  # the warm-up: open loop, each text once
TAIL_S = 5.0  # replicas are sampled this long after the last step
CHECKS = {"shed_p99_ms": 10.0, "admitted_p99_x_knee": 3.0, "admitted_p99_floor_ms": 50.0,
          "vector_p99_x_baseline": 3.0, "answered_share_below_capacity": 0.95}
# Who refused a 503, from its body.
REFUSERS = {"edge": "edge queue full", "text_admission": "texts waiting for the embedder",
            "embed_timeout": "did not answer within"}


# --- the server ----------------------------------------------------------------------------------

def start_server(index: str, port: int, log: Path, nice: int) -> subprocess.Popen:
    """`shardserve serve INDEX --port PORT` in a session of its own (so Ctrl-C reaches its tree)."""
    exe = Path(sys.executable).parent / "shardserve"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    niced = ["nice", "-n", str(nice)] if nice else []
    with log.open("ab") as sink:
        return subprocess.Popen([*niced, str(exe), "serve", index, "--port", str(port)], env=env,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_banner(server: subprocess.Popen, log: Path, timeout_s: float = 300.0) -> list[str]:
    """Until the server printed "Ctrl-C stops it." (healthy, warm pool filled): its banner lines."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if "Ctrl-C stops it." in text:
            lines = text.splitlines()
            first = next(i for i, line in enumerate(lines) if line.startswith("shardserve: serving"))
            return lines[first:]
        if server.poll() is not None:
            raise SystemExit(f"`shardserve serve` exited with {server.returncode} before it served: "
                             f"{text[-2000:]}")
        time.sleep(0.5)
    raise SystemExit(f"`shardserve serve` not serving after {timeout_s:.0f} s")


def ray_address(banner: list[str]) -> str:
    for line in banner:
        if found := re.search(r"ray:\s+its own, at (\S+)", line):
            return found.group(1)
    raise SystemExit(f"no Ray address in the server's banner: {banner}")


# --- the load ------------------------------------------------------------------------------------

def text_pools(docs: int) -> tuple[list[str], list[str]]:
    """Fortunes not in the index (the first `docs` are): those the text steps send (and their
    variants), and VECTOR_TEXTS others, whose embeddings the vector load sends."""
    from shardserve.embed.text_data import real_texts
    from shardserve.embed.validate import MAX_TEXT_CHARS

    usable = [t for t in real_texts(source="fortunes")[docs:] if len(t) <= MAX_TEXT_CHARS]
    if len(usable) < VECTOR_TEXTS + 500:
        raise SystemExit(f"only {len(usable)} fortunes are not indexed: fewer --docs")
    return usable[:-VECTOR_TEXTS], usable[-VECTOR_TEXTS:]


def embed_in_process(model: str, texts: list[str]) -> np.ndarray:
    """The vector load's queries: real embeddings, here, before the server starts."""
    from shardserve.embed.model import Embedder

    return Embedder(model).embed(texts)


class VectorLoad:
    """One open-loop vegeta of vector searches, from `start()` until `stop()` (SIGINT: vegeta stops
    sending, waits for what is in flight and writes its results)."""

    def __init__(self, targets: Path, rate: float, out: Path, longest_s: float):
        self.out = out
        self.flags = [*attack_flags(targets, longest_s, rate=rate, timeout_s=VEGETA_TIMEOUT_S,
                                    max_workers=256), f"-output={out}"]
        self.process: subprocess.Popen | None = None

    def start(self) -> VectorLoad:
        self.process = subprocess.Popen([vegeta(), "attack", *self.flags])
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=VEGETA_TIMEOUT_S + 10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class TextStep:
    """One step's open-loop vegeta of texts, started at once; `finish()` waits for its answers (it may
    run on into the next step, which starts on time beside it) and decodes them."""

    def __init__(self, number: int, kind: str, rate: int, texts: list[str], url: str, k: int,
                 seconds: float, work: Path):
        from loadtests.bench_text import text_targets

        self.step: dict = {"step": number, "kind": kind, "rate": rate, "targets": len(texts)}
        self.seconds, self.out = seconds, work / f"texts-{number}.bin"
        targets = write_targets(work / f"texts-{number}.jsonl", text_targets(texts, url, k, {}))
        flags = attack_flags(targets, seconds, rate=rate, timeout_s=VEGETA_TIMEOUT_S, max_workers=1024)
        print(f"step {number} ({kind}): {rate} unique texts/s for {seconds:g} s", flush=True)
        self.step["started_at"] = time.time()
        with self.out.open("wb") as sink:
            self.process = subprocess.Popen([vegeta(), "attack", *flags], stdout=sink)

    def finish(self) -> dict:
        try:
            self.process.wait(timeout=self.seconds + VEGETA_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.step["ended_at"] = time.time()
        hits = decode(self.out)
        figures = text_figures(hits, self.seconds)
        figures["cycled"] = len(hits) > self.step["targets"]  # vegeta came round to its first text again
        self.step.update(text=figures, hits=hits)
        print(f"  step {self.step['step']} texts: {figures['offered_per_s']}/s offered, "
              f"{figures['ok_per_s']} 200/s (p50 {figures['ok_p50_ms']} p99 {figures['ok_p99_ms']} ms), "
              f"{figures['shed_per_s']} 503/s (p99 {figures['shed_p99_ms']} ms, by {figures['shed_by']}), "
              f"other {figures['other_statuses']}", flush=True)
        return self.step

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# --- figures -------------------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def refuser(hit: dict) -> str:
    """Who answered a 503, from its body. The edge's two (its queue full, and the backstop: a request
    queued for its queue timeout) share a body: told apart by the latency, at once or after it."""
    from serving.edge import DEFAULT_QUEUE_TIMEOUT_MS

    body = base64.b64decode(hit.get("body") or b"").decode(errors="replace")
    name = next((name for name, words in REFUSERS.items() if words in body), "other")
    if name == "edge":
        late = hit["latency"] / 1e6 >= DEFAULT_QUEUE_TIMEOUT_MS / 2
        return "edge_after_queue_timeout" if late else "edge_at_once"
    return name


def text_figures(hits: list[dict], seconds: float) -> dict:
    """One text step: rates per second of its length, latencies by status, who refused."""
    by_code: dict[str, list[float]] = {}
    for hit in hits:
        by_code.setdefault(str(hit["code"]), []).append(hit["latency"] / 1e6)
    ok, shed = by_code.get("200", []), by_code.get("503", [])
    return {"sent": len(hits), "offered_per_s": round(len(hits) / seconds, 2),
            "ok_per_s": round(len(ok) / seconds, 2), "shed_per_s": round(len(shed) / seconds, 2),
            "ok_p50_ms": _pct(ok, 50), "ok_p99_ms": _pct(ok, 99),
            "shed_p50_ms": _pct(shed, 50), "shed_p99_ms": _pct(shed, 99),
            "shed_by": dict(Counter(refuser(h) for h in hits if h["code"] == 503)),
            "other_statuses": {code: len(v) for code, v in sorted(by_code.items())
                               if code not in ("200", "503")},
            "errors": dict(Counter(h["error"][:120] for h in hits if h.get("error") and h["code"] != 503)
                           .most_common(5))}


def vector_figures(hits: list[dict], seconds: float) -> dict:
    latencies = [h["latency"] / 1e6 for h in hits]
    ok = [h["latency"] / 1e6 for h in hits if h["code"] == 200]
    return {"sent": len(hits), "rate_per_s": round(len(hits) / seconds, 2) if seconds else None,
            "p50_ms": _pct(latencies, 50), "p99_ms": _pct(latencies, 99), "ok_p99_ms": _pct(ok, 99),
            "errors": len(hits) - len(ok),
            "statuses": dict(Counter(str(h["code"]) for h in hits))}


def in_window(hits: list[dict], start: float, end: float) -> list[dict]:
    return [h for h in hits if start <= parse_timestamp(h["timestamp"]) < end]


def replica_counts(samples: list[dict], start: float, end: float) -> dict[str, list[int]]:
    counts: dict[str, list[int]] = {}
    for sample in samples:
        if "replicas" in sample and start <= sample["t"] <= end:
            for name, n in sample["replicas"].items():
                counts.setdefault(name, []).append(n)
    return counts


def before(samples: list[dict], t: float) -> dict[str, int]:
    rows = [s for s in samples if "replicas" in s and s["t"] < t]
    return rows[-1]["replicas"] if rows else {}


def checks(record: dict) -> dict:
    """The must-show checks, each with the figures it was decided on."""
    from deployments.config import EMBEDDER

    steps, samples = record["steps"], record["replicas"]
    ramp_start, ramp_end = record["ramp_started_at"], record["ramp_ended_at"] + TAIL_S
    # (a) the embedder scaled, the shards did not
    at_start = before(samples, ramp_start)
    during = replica_counts(samples, ramp_start, ramp_end)
    embedder = during.get(EMBEDDER, [])
    shards = {name: sorted(set(v)) for name, v in during.items() if name.startswith("shard-")}
    first_up = next((round(s["t"] - ramp_start, 1) for s in samples
                     if "replicas" in s and ramp_start <= s["t"] <= ramp_end
                     and s["replicas"].get(EMBEDDER, 0) > at_start.get(EMBEDDER, 0)), None)
    scaling = {"embedder_before_ramp": at_start.get(EMBEDDER), "embedder_peak": max(embedder, default=None),
               "embedder_rose_at_s_into_ramp": first_up,
               "shard_replicas_seen": shards, "shards_before_ramp": {n: at_start.get(n) for n in shards},
               "router_replicas_seen": sorted(set(during.get("Router", []))),
               "embedder_rose": bool(embedder) and max(embedder) > at_start.get(EMBEDDER, 0),
               "shards_unchanged": bool(shards) and all(v == [at_start.get(n)] for n, v in shards.items())}
    scaling["met"] = scaling["embedder_rose"] and scaling["shards_unchanged"]
    # (b) past capacity: refused fast, admitted bounded
    share = CHECKS["answered_share_below_capacity"]
    below = [s for s in steps if s["kind"] == "ramp" and s["text"]["offered_per_s"]
             and s["text"]["ok_per_s"] >= share * s["text"]["offered_per_s"] and not s["text"]["shed_per_s"]]
    knee = max(below, key=lambda s: s["text"]["offered_per_s"], default=None)
    past = [s for s in steps if s["kind"] == "overload" or s["text"]["shed_per_s"]
            or s["text"]["ok_per_s"] < share * s["text"]["offered_per_s"]]
    bound = (max(CHECKS["admitted_p99_x_knee"] * knee["text"]["ok_p99_ms"], CHECKS["admitted_p99_floor_ms"])
             if knee and knee["text"]["ok_p99_ms"] is not None else None)
    overload = next((s for s in steps if s["kind"] == "overload"), None)
    per_step = []
    for step in past:
        text = step["text"]
        shown = ("offered_per_s", "ok_per_s", "shed_per_s", "shed_p99_ms", "ok_p99_ms", "shed_by",
                 "other_statuses")
        per_step.append({"step": step["step"], **{key: text[key] for key in shown},
                         "shed_fast": text["shed_p99_ms"] is None
                         or text["shed_p99_ms"] < CHECKS["shed_p99_ms"],
                         "admitted_bounded": None if bound is None or text["ok_p99_ms"] is None
                         else text["ok_p99_ms"] <= bound})
    shedding = {"knee_step": knee["step"] if knee else None,
                "knee_step_ok_p99_ms": knee["text"]["ok_p99_ms"] if knee else None,
                "admitted_p99_bound_ms": round(bound, 3) if bound is not None else None,
                "bound": f"max({CHECKS['admitted_p99_x_knee']:g} x the knee step's 200 p99, "
                         f"{CHECKS['admitted_p99_floor_ms']:g} ms); 503 p99 < {CHECKS['shed_p99_ms']:g} ms",
                "past_capacity_steps": per_step,
                "overload_refused": bool(overload and overload["text"]["shed_per_s"]),
                "text_admission_refused": sum(s["text"]["shed_by"].get("text_admission", 0) for s in steps),
                "edge_refused_texts": {how: sum(s["text"]["shed_by"].get(how, 0) for s in steps)
                                       for how in ("edge_at_once", "edge_after_queue_timeout")},
                "only_200_or_503": all(not s["other_statuses"] for s in per_step)}
    shedding["met"] = bool(per_step) and shedding["overload_refused"] and shedding["only_200_or_503"] \
        and all(s["shed_fast"] and s["admitted_bounded"] for s in per_step)
    if knee is None:
        shedding["note"] = ("no step answered >= 95 % with no 503: no knee step, the admitted bound is "
                            "undefined")
    # (c) the vectors beside the texts
    base = record["baseline"]["vector"]["p99_ms"]
    vec_bound = CHECKS["vector_p99_x_baseline"] * base if base else None
    vectors = [{"step": s["step"], "p99_ms": s["vector"]["p99_ms"], "errors": s["vector"]["errors"],
                "x_baseline": round(s["vector"]["p99_ms"] / base, 2)
                if base and s["vector"]["p99_ms"] else None,
                "met": vec_bound is not None and s["vector"]["p99_ms"] is not None
                and s["vector"]["p99_ms"] <= vec_bound} for s in steps]
    isolation = {"baseline_p99_ms": base, "bound_ms": round(vec_bound, 3) if vec_bound else None,
                 "per_step": vectors, "met": bool(vectors) and all(v["met"] for v in vectors)}
    return {"a_embedder_scales_shards_do_not": scaling, "b_overload_refused_fast_admitted_bounded": shedding,
            "c_vector_p99_within_3x_baseline": isolation,
            "all_met": scaling["met"] and shedding["met"] and isolation["met"]}


def knee_crossings(app: str) -> dict[str, list[dict]]:
    """The knee policy's crossings of every deployment of the index app (Embedder, shards)."""
    from deployments.autoscaling import knee_events
    from deployments.config import index_app_name
    from deployments.run import shard_replicas

    return {name: knee_events(index_app_name(app), name) for name in shard_replicas(app)}


# --- the plot ------------------------------------------------------------------------------------

def plot(record: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = record["start"]
    text, vec = record["seconds"]["text"], record["seconds"]["vector"]
    fig, (ax_rate, ax_lat, ax_rep) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ts = [r["t"] for r in text]
    ax_rate.plot(ts, [r["sent"] for r in text], color="grey", label="texts offered/s")
    ax_rate.plot(ts, [r["ok"] for r in text], color="tab:green", label="texts 200/s")
    ax_rate.plot(ts, [r["status_codes"].get("503", 0) for r in text], color="tab:red", label="texts 503/s")
    ax_rate.plot([r["t"] for r in vec], [r["sent"] for r in vec], color="tab:blue", alpha=0.5,
                 label="vectors sent/s")
    ax_rate.set_ylabel("requests / s")
    ax_rate.legend(fontsize=8, loc="upper left")
    ax_lat.plot([r["t"] for r in vec], [r["p99_ms"] for r in vec], color="tab:blue", label="vector p99")
    for code, color in (("200", "tab:green"), ("503", "tab:red")):
        rows = [r for r in text if code in r["p99_ms_by_status"]]
        ax_lat.plot([r["t"] for r in rows], [r["p99_ms_by_status"][code] for r in rows], ".", color=color,
                    label=f"text {code} p99")
    bound = record["checks"]["c_vector_p99_within_3x_baseline"]["bound_ms"]
    if bound:
        ax_lat.axhline(bound, color="tab:blue", linestyle=":", label="3x baseline vector p99")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms (per second sent)")
    ax_lat.legend(fontsize=8, loc="upper left")
    samples = [s for s in record["replicas"] if "replicas" in s]
    for name in sorted({n for s in samples for n in s["replicas"]}):
        ax_rep.step([s["t"] - start for s in samples], [s["replicas"].get(name, 0) for s in samples],
                    where="post", label=name)
    for event in record["knee_events"].get("Embedder", []):
        if event["t"] >= start:
            ax_rep.plot(event["t"] - start, event["replicas"], "kv", markersize=6)
    ax_rep.plot([], [], "kv", label="Embedder knee crossed")
    ax_rep.set_ylabel("RUNNING replicas")
    ax_rep.set_xlabel("seconds")
    ax_rep.legend(fontsize=8, loc="upper left")
    for ax in (ax_rate, ax_lat, ax_rep):
        for step in [record["baseline"], *record["steps"]]:
            ax.axvline(step["start_s"], color="grey", linestyle=":", linewidth=0.8)
    for step in record["steps"]:
        ax_rate.annotate(f"{step['rate']}/s", (step["start_s"], 1), xycoords=("data", "axes fraction"),
                         fontsize=7, va="top")
    fig.suptitle(f"{record['name']}: unique texts ramp beside {record['settings']['vector_rate']:g} vector "
                 "searches/s")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


# --- the run -------------------------------------------------------------------------------------

def run(args: argparse.Namespace, index: str, work: Path) -> dict:
    import ray

    from deployments.config import AppArgs, default_embedder_autoscaling
    from loadtests.bench_text import text_targets, unique_stream
    from loadtests.during import ReplicaWatcher
    from loadtests.shedding import ctrl_c
    from serving.edge import DEFAULT_QUEUE_TIMEOUT_MS, DEFAULT_TEXT_IN_FLIGHT, DEFAULT_TEXT_QUEUE
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location
    from shardserve.runtime.ports import free_port

    manifest = read_manifest(Location.parse(index))
    if manifest.embedder is None:
        raise SystemExit(f"{index} was not built from text (its manifest names no embedder)")
    rates = [int(r) for r in args.rates.split(",")]
    pool, vector_texts = text_pools(manifest.num_vectors)
    # enough for every step (the last is at most 2x the highest rate) with a margin, each sent once
    per_step = [math.ceil(1.05 * r * args.step_s) + 5 for r in [*rates, 2 * max(rates)]]
    stream = unique_stream(pool, WARM_TEXTS + sum(per_step), SEED)
    print(f"embedding {len(vector_texts)} fortunes in-process for the vector load", flush=True)
    vectors = embed_in_process(manifest.embedder.name, vector_texts)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "serve.log"
    print(f"starting: shardserve serve {index} --port {port} (nice {args.server_nice})", flush=True)
    server = start_server(index, port, log, args.server_nice)
    vector_load: VectorLoad | None = None
    running: list[TextStep] = []
    connected = False
    stop: dict = {}
    try:
        banner = wait_for_banner(server, log)
        print("\n".join(banner), flush=True)
        ray.init(address=ray_address(banner), log_to_driver=False, configure_logging=False)
        connected = True
        vector_targets = write_targets(work / "vectors.jsonl", make_targets(vectors, url, args.k, None, 0,
                                                                            len(vectors)))
        cursor = WARM_TEXTS
        warm = write_targets(work / "warm.jsonl", text_targets(stream[:WARM_TEXTS], url, args.k, {}))
        print(f"warm-up (unrecorded): {WARM_RATE} texts/s, then {args.vector_rate:g} vectors/s, "
              f"{WARM_S:g} s each", flush=True)
        warm_up = {"texts": attack(warm, "rate", WARM_RATE, WARM_S, work, "warm-texts"),
                   "vectors": attack(vector_targets, "rate", args.vector_rate, WARM_S, work, "warm-vectors")}
        time.sleep(3)
        planned = (1 + len(rates) + 1) * args.step_s
        with ReplicaWatcher(args.app, 1.0, router=True) as watcher:
            time.sleep(2)  # samples before the load
            start = time.time()
            vector_load = VectorLoad(vector_targets, args.vector_rate, work / "vectors.bin",
                                     3 * planned + 120).start()
            print(f"baseline: {args.vector_rate:g} vectors/s alone for {args.step_s:g} s", flush=True)
            time.sleep(args.step_s)
            ramp_started = time.time()
            steps: list[dict] = []

            def texts_for(rate: int) -> list[str]:
                nonlocal cursor
                count = math.ceil(1.05 * rate * args.step_s) + 5
                texts, cursor = stream[cursor:cursor + count], cursor + count
                if len(texts) < count:
                    raise SystemExit(f"not enough distinct texts for {rate}/s x {args.step_s} s")
                return texts

            # The ramp's steps start on schedule, each beside the previous one's last answers; the
            # overload step once the last ramp step has answered (its rate is 2x the most answered).
            previous: TextStep | None = None
            for number, rate in enumerate(rates):
                time.sleep(max(0.0, ramp_started + number * args.step_s - time.time()))
                current = TextStep(number, "ramp", rate, texts_for(rate), url, args.k, args.step_s, work)
                running.append(current)
                if previous is not None:
                    steps.append(previous.finish())
                previous = current
            if previous is not None:
                steps.append(previous.finish())
            rate = max(1, round(2 * max(s["text"]["ok_per_s"] for s in steps)))
            overload = TextStep(len(rates), "overload", rate, texts_for(rate), url, args.k, args.step_s, work)
            running.append(overload)
            steps.append(overload.finish())
            ramp_ended = time.time()
            vector_load.stop()
            time.sleep(TAIL_S)
        vector_hits = decode(work / "vectors.bin")
        crossings = knee_crossings(args.app)
        ray.shutdown()
        connected = False
    finally:
        if vector_load is not None:
            vector_load.stop()
        for each in running:
            each.stop()
        if connected:
            ray.shutdown()
        stop = ctrl_c(server)
        print(f"Ctrl-C: {stop}", flush=True)
    baseline = {"started_at": start, "start_s": 0.0, "seconds": args.step_s,
                "vector": vector_figures(in_window(vector_hits, start, ramp_started), ramp_started - start)}
    bounds = [s["started_at"] for s in steps[1:]] + [ramp_ended]
    for step, end in zip(steps, bounds, strict=True):
        step["vector"] = vector_figures(in_window(vector_hits, step["started_at"], end),
                                        end - step["started_at"])
        step["start_s"] = round(step["started_at"] - start, 2)
        step["lasted_s"] = round(step["ended_at"] - step["started_at"], 2)
    text_hits = [h for s in steps for h in s.pop("hits")]
    app_args = AppArgs(index=index)
    record = header(
        args.name, index={"path": index, "version": manifest.index_version, "factory": manifest.index_factory,
                          "shards": len(manifest.shards), "num_vectors": manifest.num_vectors,
                          "metric": manifest.metric, "embedder": manifest.embedder.name},
        server={"command": f"shardserve serve INDEX --port {port}", "nice": args.server_nice,
                "banner": banner, "ctrl_c": stop},
        settings={"step_s": args.step_s, "rates": rates,
                  "overload": "2x the highest 200s/s of the steps before",
                  "vector_rate": args.vector_rate, "k": args.k, "vegeta_timeout_s": VEGETA_TIMEOUT_S,
                  "embedder_autoscaling": default_embedder_autoscaling(),
                  "max_texts_in_flight": app_args.max_texts_in_flight,
                  "embed_timeout_s": app_args.embed_timeout_s, "router_replicas": app_args.router_replicas,
                  "shard_autoscaling": app_args.shard_autoscaling,
                  "edge_text_lane": {"in_flight": DEFAULT_TEXT_IN_FLIGHT, "queue": DEFAULT_TEXT_QUEUE,
                                     "queue_timeout_ms": DEFAULT_QUEUE_TIMEOUT_MS}},
        checks_bounds=CHECKS,
        texts={"source": "Debian fortunes not in the index, then '<n>. <fortune>' variants, each sent once",
               "pool": len(pool), "sent": len(text_hits),
               "distinct_sent": sum(min(s["text"]["sent"], s["targets"]) for s in steps),
               "any_step_cycled": any(s["text"]["cycled"] for s in steps)},
        vectors={"source": f"{len(vectors)} fortunes not in the index, embedded in-process "
                           f"({manifest.embedder.name})",
                 "sent": len(vector_hits)},
        warm_up=warm_up, start=start, ramp_started_at=ramp_started, ramp_ended_at=ramp_ended,
        baseline=baseline, steps=steps, replicas=watcher.samples, knee_events=crossings,
        seconds={"text": per_second_of(text_hits, start), "vector": per_second_of(vector_hits, start)},
        not_covered=["one router replica (the default); the router's own autoscaling is not exercised",
                     "single-text requests only (no `texts` batches)", "loopback, one 2-core machine shared "
                     "with vegeta (the server at nice --server-nice)",
                     "no cool-down: scale-down is not shown"])
    record["checks"] = checks(record)
    return record


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--index", help="a text index (its first --docs fortunes); default: build one in --work")
    cli.add_argument("--docs", type=int, default=8000, help="fortunes indexed when building")
    cli.add_argument("--work", help="keep the built index and the load files here (default: a temp dir)")
    cli.add_argument("--step-s", type=float, default=20.0, help="seconds per step")
    cli.add_argument("--rates", default="10,30,60,100", help="unique texts/s of the ramp's steps")
    cli.add_argument("--vector-rate", type=float, default=20.0, help="vector searches/s throughout")
    cli.add_argument("--k", type=int, default=10)
    cli.add_argument("--app", default="shardserve")
    cli.add_argument("--server-nice", type=int, default=SERVER_NICE,
                     help="niceness `shardserve serve` starts at")
    cli.add_argument("--name", default="autoscale-text")
    cli.add_argument("--out", default=str(RECORDS))
    args = cli.parse_args()
    vegeta()  # built, or say what to run before anything starts
    if os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").exists():
        # as serving/cli.py main: the server's own Ray uses token auth, and this driver joins it only
        # in token mode (set before Ray is imported)
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()  # before ray.serve is imported here (the replica watcher reads its status)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="autoscale-text-")))
        work.mkdir(parents=True, exist_ok=True)
        if args.index:
            index = os.path.abspath(args.index)
        else:
            from loadtests.bench_text import build_text_index
            from shardserve.embed.text_data import real_texts

            index = str(build_text_index(work, real_texts(args.docs, source="fortunes"), 2, "Flat"))
        record = run(args, index, work)
    record["wall_s"] = round(time.monotonic() - started, 1)
    path = save(record, Path(args.out), plot_levels=False)
    plot(record, path.with_suffix(".png"))
    summary = record["checks"]
    print(f"baseline vector p99 {record['baseline']['vector']['p99_ms']} ms")
    print("step kind       rate  200/s  503/s  200 p99  503 p99  vec p99  embedder")
    for step in record["steps"]:
        text = step["text"]
        seen = replica_counts(record["replicas"], step["started_at"], step["ended_at"])
        peak = max(seen.get("Embedder", [0]))
        print(f"{step['step']:>4} {step['kind']:<9} {step['rate']:>5} {text['ok_per_s']:>6} "
              f"{text['shed_per_s']:>6} "
              f"{text['ok_p99_ms']!s:>8} {text['shed_p99_ms']!s:>8} {step['vector']['p99_ms']!s:>8}  {peak}")
    for name in ("a_embedder_scales_shards_do_not", "b_overload_refused_fast_admitted_bounded",
                 "c_vector_p99_within_3x_baseline"):
        print(f"{name}: {'met' if summary[name]['met'] else 'NOT met'}")
    print(f"record: {path} ({record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
