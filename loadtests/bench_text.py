"""`make bench-text`: text search on `shardserve serve` beside the monolith a user would write instead
(loadtests/text_monolith.py: uvicorn + FastAPI + ONNX Runtime + FAISS, a worker per core, one thread
each), side by side in one run: one record, named bench-text, in loadtests/records.

The corpus: the first --docs (8,000) of Debian's fortunes (shardserve.embed.text_data.real_texts), one
a line in a .txt file, indexed by the CLI as a user indexes text:
    shardserve build --dataset corpus.txt --text-column text --embedder all-MiniLM-L6-v2 --shards 2
                     --index Flat --out DIR
The queries: fortunes that are not indexed, then numbered variants of them ("3. <fortune>"), shuffled
with a fixed seed. Each text is sent at most once to a server: the warm-up, the 32-client and the
1-client levels take disjoint slices, each longer than --max-qps x its seconds (vegeta cycles
through its targets: every level records whether it came round to its first again, `cycled`), and every server
is started afresh, so no cache of any side ever holds a text it is asked.

Per round (--rounds, the sides in alternating order, each started afresh, after a warm-up on texts of
its own; shardserve also after its warm pool filled, its idle CPU then recorded):
(a) unique texts at 32 clients: queries/s and CPU per request, `shardserve serve INDEX` exactly as a
    user starts it against the monolith;
(b) unique texts at one client: p50 and p99 of both;
(c) a Zipf mix (exponent --zipf-exponent over --zipf-texts distinct fortunes none of the other levels
    sends, numpy's zipf with a fixed seed, truncated by rejection) at 32 clients: shardserve with its
    embedding cache (the default: the same server as (a) and (b)), shardserve with the cache off
    (`--arg embedding_cache_bytes=0`), and the monolith with `--cache-entries 4096` for reference.
Closed-loop vegeta levels on loopback, each --duration seconds; CPU per request by process class
(shardserve.runtime.procfs.CpuMeter). The ratios are taken over the rounds, every figure from the run.

    python -m loadtests.bench_text [--work DIR] [--index TEXT_INDEX] [--only monolith]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from loadtests.record import RECORDS, new_record, save, work_dir
from loadtests.vegeta_run import attack, vegeta, write_targets
from shardserve.runtime.procfs import SELF_CLASS, CpuMeter, cmdline, cpu_seconds, descendants, process_class

MODEL = "all-MiniLM-L6-v2"
EDGE_PORT = 18014  # `shardserve serve --port`: its edge
MONOLITH_PORT = 18110
# Warm-up at 32 clients, long enough for the embedder's autoscaler to react to it (its upscale delay,
# a replica's start): the levels then measure the steady state, as make bench's do after its warm-up.
WARM_S = 20.0
WARM_CLIENTS = 32
SEED = 20_251
# The sides, as level labels `<side>-<kind>-<round>`.
MONOLITH, SERVED = "monolith", "shardserve"
SERVED_NO_CACHE, MONOLITH_LRU = "shardserve-nocache", "monolith-lru4096"
MONOLITH_LRU_ENTRIES = 4096
NO_CACHE_ARG = "embedding_cache_bytes=0"  # deployments/config.py AppArgs, through `serve --arg`

# What the issue asks of shardserve's text path, measured against the monolith.
TARGETS = {"qps_unique_c32_vs_monolith": (">=", 1.2),
           "cpu_per_request_unique_c32_vs_monolith": ("<=", 0.9),
           "c1_p50_minus_monolith_c1_p50_ms": ("<=", 1.0),
           "zipf_qps_cache_vs_no_cache": (">=", 3.0)}


# --- queries -------------------------------------------------------------------------------------

@dataclass
class QuerySets:
    """The texts each level sends, in the order vegeta takes them."""

    warm: list[str]
    wide: list[str]  # unique, 32 clients
    one: list[str]  # unique, 1 client
    zipf: list[str]  # the Zipf sequence, over `zipf_texts` distinct texts
    zipf_texts: int
    unique_pool: int  # distinct fortunes behind the unique sets (before their variants)

    def of(self, kind: str) -> list[str]:
        return {"warm": self.warm, "unique-c32": self.wide, "unique-c1": self.one, "zipf": self.zipf}[kind]


def unique_stream(pool: list[str], count: int, seed: int) -> list[str]:
    """`count` distinct texts: the pool shuffled, then "1. <text>", "2. <text>"... of it, each block
    shuffled (a fixed seed: the same texts on every run)."""
    rng = np.random.default_rng(seed)
    out: list[str] = []
    seen: set[str] = set()
    for number in itertools.count():
        block = pool if number == 0 else [f"{number}. {text}" for text in pool]
        for position in rng.permutation(len(block)):
            text = block[position]
            if text not in seen:
                seen.add(text)
                out.append(text)
                if len(out) == count:
                    return out
    raise AssertionError("unreachable")


def zipf_sequence(texts: list[str], count: int, exponent: float, seed: int) -> list[str]:
    """`count` draws from `texts` by rank under a Zipf law of `exponent` (numpy's zipf, ranks past
    len(texts) drawn again); which text holds which rank is shuffled with the same seed."""
    rng = np.random.default_rng(seed)
    by_rank = [texts[i] for i in rng.permutation(len(texts))]
    ranks: list[np.ndarray] = []
    drawn = 0
    while drawn < count:
        batch = rng.zipf(exponent, size=2 * count)
        batch = batch[batch <= len(texts)]
        ranks.append(batch)
        drawn += len(batch)
    return [by_rank[rank - 1] for rank in np.concatenate(ranks)[:count]]


def query_sets(not_indexed: list[str], per_level: int, warm: int, zipf_texts: int, exponent: float,
               seed: int = SEED) -> QuerySets:
    """Zipf texts: the last `zipf_texts` fortunes of `not_indexed`; the unique sets: the others and their
    variants, warm-up, then the 32-client level, then the 1-client level, disjoint."""
    from shardserve.embed.validate import MAX_TEXT_CHARS

    usable = [text for text in not_indexed if len(text) <= MAX_TEXT_CHARS]
    if len(usable) < zipf_texts + 100:
        raise SystemExit(f"only {len(usable)} texts are not indexed: fewer --docs, or fewer --zipf-texts")
    pool, zipf_pool = usable[:-zipf_texts], usable[-zipf_texts:]
    stream = unique_stream(pool, warm + 2 * per_level, seed)
    return QuerySets(warm=stream[:warm], wide=stream[warm:warm + per_level], one=stream[warm + per_level:],
                     zipf=zipf_sequence(zipf_pool, per_level, exponent, seed + 1), zipf_texts=zipf_texts,
                     unique_pool=len(pool))


def text_targets(texts: list[str], url: str, k: int, params: dict) -> list[bytes]:
    """One vegeta JSON target per text (bodies base64), in order."""
    endpoint = url.rstrip("/") + "/v1/search"
    header = {"Content-Type": ["application/json"]}
    lines = []
    for text in texts:
        body: dict = {"text": text, "k": k}
        if params:
            body["params"] = params
        lines.append(orjson.dumps({"method": "POST", "url": endpoint, "header": header,
                                   "body": base64.b64encode(orjson.dumps(body)).decode()}))
    return lines


def token_stats(texts: list[str]) -> dict:
    """Characters and model tokens ([CLS] and [SEP] included, at most the model's limit) of `texts`."""
    from tokenizers import Tokenizer

    from shardserve.embed.model_files import resolve_model

    files = resolve_model(MODEL)
    tokenizer = Tokenizer.from_file(str(files.tokenizer))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=files.pooling.max_tokens)
    tokens = np.array([len(e.ids) for e in tokenizer.encode_batch(texts)]) if texts else np.zeros(1)
    chars = np.array([len(text) for text in texts]) if texts else np.zeros(1)
    return {"texts": len(texts), "tokens_mean": round(float(tokens.mean()), 1),
            "tokens_p50": float(np.percentile(tokens, 50)), "tokens_p99": float(np.percentile(tokens, 99)),
            "chars_mean": round(float(chars.mean()), 1)}


class TreeMeter(CpuMeter):
    """A CpuMeter over the process trees of `roots` (and this process) alone: a process of the stack
    named by its class (procfs.process_class: Ray system, router, HAProxy...), any other by its root's
    name. CpuMeter itself counts every Ray process on the machine as the system's: another Ray there
    (someone's build or tests) would be billed to the server measured, even to the monolith."""

    def __init__(self, roots: dict[str, int]):
        super().__init__(include_self=True)
        self.roots = roots

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        classes = {os.getpid(): SELF_CLASS}
        for name, root in self.roots.items():
            for pid in [root, *descendants(root)]:
                classes[pid] = process_class(cmdline(pid)) or name
        return {pid: (name, cpu_seconds(pid)) for pid, name in classes.items()}


# --- servers -------------------------------------------------------------------------------------

def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, log: Path | None = None) -> None:
    """GET /v1/health answers 200, or SystemExit as soon as the server has exited (or at the timeout)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise SystemExit(f"{process.args!r} exited with {process.returncode} before {url} was "
                             f"healthy{': ' + tail if tail else ''}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/v1/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise SystemExit(f"{url} not healthy after {timeout_s:.0f} s")


@contextlib.contextmanager
def monolith(index: str, cache_entries: int = 0) -> Iterator[tuple[str, dict[str, int]]]:
    """loadtests.text_monolith on `index`, a worker per core, up: (its URL, its process tree)."""
    url = f"http://127.0.0.1:{MONOLITH_PORT}"
    cache = ["--cache-entries", str(cache_entries)] if cache_entries else []
    process = subprocess.Popen([sys.executable, "-m", "loadtests.text_monolith", index,
                                "--port", str(MONOLITH_PORT), *cache], start_new_session=True)
    try:
        _wait_healthy(url, process, 180)
        yield url, {"monolith (uvicorn)": process.pid}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def served(index: str, log: Path, extra: list[str]) -> Iterator[tuple[str, dict[str, int]]]:
    """`shardserve serve INDEX` as a user starts it (the port, and `extra` CLI arguments, aside),
    healthy: (its URL, its process tree: the command starts its own Ray, every process of which
    descends from it); Ctrl-C afterwards (loadtests.shedding.ctrl_c, as make bench stops it)."""
    from loadtests.shedding import ctrl_c
    from shardserve.runtime.ray_private import local_cluster_running

    if local_cluster_running():
        raise SystemExit("error: `shardserve serve` must start its own Ray here; stop the local one first")
    url = f"http://127.0.0.1:{EDGE_PORT}"
    with log.open("ab") as sink:
        process = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", index,
                                    "--port", str(EDGE_PORT), *extra], stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        _wait_healthy(url, process, 300, log)
        yield url, {"shardserve serve": process.pid}
    finally:
        with contextlib.suppress(ProcessLookupError):  # a server that failed to start: its session gone
            ctrl_c(process)


# --- levels --------------------------------------------------------------------------------------

@dataclass
class TextBench:
    queries: QuerySets
    k: int
    params: dict
    duration: float
    work: Path
    levels: list[dict] = field(default_factory=list)
    idle: dict[str, dict] = field(default_factory=dict)
    _targets: dict[tuple[str, str], Path] = field(default_factory=dict)

    def targets(self, url: str, kind: str) -> Path:
        key = (url, kind)
        if key not in self._targets:
            name = f"{kind}-{url.rsplit(':', 1)[-1]}.jsonl"
            self._targets[key] = write_targets(self.work / name,
                                               text_targets(self.queries.of(kind), url, self.k, self.params))
        return self._targets[key]

    def warm_up(self, url: str) -> None:
        """Unrecorded load on texts no level sends: connections open, the model's first runs, and the
        embedder scaled to the load (shardserve)."""
        attack(self.targets(url, "warm"), "concurrency", WARM_CLIENTS, WARM_S, self.work, "warm-up")

    def steady(self, label: str, index: str, servers: dict[str, int], quiet_s: float = 5.0) -> None:
        """Wait until the node's warm pool is full (at most 60 s), then record `quiet_s` of idle CPU per
        process class (as make bench's Bench.steady)."""
        from deployments.config import AppArgs
        from loadtests.autoscale import pooled_on_this_node, wait_until_pooled

        wait_until_pooled(AppArgs(index=index).warm_workers, timeout_s=60.0)
        meter = TreeMeter(servers)
        meter.start()
        time.sleep(quiet_s)
        self.idle[label] = {cls: round(100 * cpu / quiet_s, 2) for cls, cpu in sorted(meter.stop().items())}
        self.idle[label]["warm_pool"] = len(pooled_on_this_node())

    def run(self, url: str, label: str, kind: str, clients: int, servers: dict[str, int]) -> dict:
        texts = self.queries.of(kind)
        level = attack(self.targets(url, kind), "concurrency", clients, self.duration, self.work, label,
                       meter=TreeMeter(servers))
        level["texts"] = kind
        level["targets"] = len(texts)
        level["cycled"] = level["requests"] > len(texts)  # vegeta came round to its first target again
        level["distinct_texts_sent"] = len(set(texts[:level["requests"]]))
        self.levels.append(level)
        cpu = level.get("cpu_ms_per_request", {})
        print(f"  {label:<26} c={clients:<3} {level['qps']:7.1f} req/s  p50 {level['p50_ms']:7.2f} ms  "
              f"p99 {level['p99_ms']:7.2f} ms  CPU/req {cpu.get('total (servers)')} ms  "
              f"codes {level['status_codes']}{'  CYCLED' if level['cycled'] else ''}", flush=True)
        elsewhere = level.get("machine_cpu", {}).get("busy_unaccounted_percent", 0.0)
        if elsewhere > 10:
            print(f"    note: {elsewhere}% of the machine busy outside the measured processes", flush=True)
        return level


def run_round(bench: TextBench, index: str, number: int, only_monolith: bool) -> None:
    """One round: every side started afresh, in this round's order (reversed every other round)."""
    def unique_monolith() -> None:
        with monolith(index) as (url, servers):
            bench.warm_up(url)
            bench.run(url, f"{MONOLITH}-unique-{number}", "unique-c32", 32, servers)
            bench.run(url, f"{MONOLITH}-unique-{number}", "unique-c1", 1, servers)

    def lru_monolith() -> None:
        with monolith(index, MONOLITH_LRU_ENTRIES) as (url, servers):
            bench.warm_up(url)
            bench.run(url, f"{MONOLITH_LRU}-zipf-{number}", "zipf", 32, servers)

    def shardserve() -> None:
        with served(index, bench.work / "serve.log", []) as (url, servers):
            bench.warm_up(url)
            bench.steady(f"{SERVED}-{number}", index, servers)
            bench.run(url, f"{SERVED}-unique-{number}", "unique-c32", 32, servers)
            bench.run(url, f"{SERVED}-unique-{number}", "unique-c1", 1, servers)
            bench.run(url, f"{SERVED}-zipf-{number}", "zipf", 32, servers)

    def shardserve_no_cache() -> None:
        with served(index, bench.work / "serve.log", ["--arg", NO_CACHE_ARG]) as (url, servers):
            bench.warm_up(url)
            bench.steady(f"{SERVED_NO_CACHE}-{number}", index, servers)
            bench.run(url, f"{SERVED_NO_CACHE}-zipf-{number}", "zipf", 32, servers)

    sides: list[Callable[[], None]] = [unique_monolith, lru_monolith] if only_monolith else \
        [unique_monolith, shardserve, shardserve_no_cache, lru_monolith]
    for side in sides if number % 2 == 0 else sides[::-1]:
        side()


# --- the record ----------------------------------------------------------------------------------

def _server_cpu(level: dict) -> float:
    return level.get("cpu_ms_per_request", {}).get("total (servers)", float("nan"))


def _of(levels: list[dict], side: str, kind: str, clients: int) -> list[dict]:
    """A side's levels of one kind over the rounds (labels `<side>-<kind>-<round>`)."""
    return [lv for lv in levels
            if lv["label"].rsplit("-", 1)[0] == f"{side}-{kind}" and lv["value"] == clients]


def pooled(levels: list[dict]) -> dict:
    """Over the rounds: mean queries/s, CPU per request over all requests, median p50 and p99, the
    lowest success ratio, the non-200 answers, and whether any level's targets ran out (`cycled`:
    vegeta sent some again; a unique level then repeated texts)."""
    if not levels:
        return {}
    requests = sum(lv["requests"] for lv in levels)
    return {"rounds": len(levels), "qps": round(statistics.mean(lv["qps"] for lv in levels), 1),
            "cpu_ms_per_request": round(sum(_server_cpu(lv) * lv["requests"] for lv in levels)
                                        / max(requests, 1), 3),
            "p50_ms": round(statistics.median(lv["p50_ms"] for lv in levels), 3),
            "p99_ms": round(statistics.median(lv["p99_ms"] for lv in levels), 3),
            "success": min(lv["success_ratio"] for lv in levels),
            "not_200": sum(n for lv in levels for code, n in lv["status_codes"].items() if code != "200"),
            "errors": sorted({e for lv in levels for e in lv.get("errors", {})}),
            "targets_cycled": any(lv.get("cycled") for lv in levels)}


def summarize_sides(levels: list[dict]) -> dict:
    summary: dict[str, Any] = {}
    for side, kind, clients in ((MONOLITH, "unique", 32), (MONOLITH, "unique", 1), (SERVED, "unique", 32),
                                (SERVED, "unique", 1), (SERVED, "zipf", 32), (SERVED_NO_CACHE, "zipf", 32),
                                (MONOLITH_LRU, "zipf", 32)):
        found = pooled(_of(levels, side, kind, clients))
        if found:
            summary.setdefault(side, {})[f"{kind}_c{clients}"] = found
    return summary


def ratios(summary: dict) -> dict[str, float | None]:
    """The issue's ratios (shardserve over the monolith, pooled over the rounds), None without a side."""
    ours, theirs = summary.get(SERVED, {}), summary.get(MONOLITH, {})
    cached, uncached = ours.get("zipf_c32"), summary.get(SERVED_NO_CACHE, {}).get("zipf_c32")
    lru = summary.get(MONOLITH_LRU, {}).get("zipf_c32")

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        return round(a[key] / b[key], 3) if a and b and b[key] else None

    wide, one = ours.get("unique_c32"), ours.get("unique_c1")
    their_wide, their_one = theirs.get("unique_c32"), theirs.get("unique_c1")
    return {"qps_unique_c32_vs_monolith": ratio(wide, their_wide, "qps"),
            "cpu_per_request_unique_c32_vs_monolith": ratio(wide, their_wide, "cpu_ms_per_request"),
            "c1_p50_minus_monolith_c1_p50_ms": round(one["p50_ms"] - their_one["p50_ms"], 3)
            if one and their_one else None,
            "zipf_qps_cache_vs_no_cache": ratio(cached, uncached, "qps"),
            # no target: for reference
            "c1_p99_minus_monolith_c1_p99_ms": round(one["p99_ms"] - their_one["p99_ms"], 3)
            if one and their_one else None,
            "zipf_qps_cache_vs_monolith_lru": ratio(cached, lru, "qps"),
            "zipf_qps_monolith_lru_vs_monolith_unique": ratio(lru, their_wide, "qps")}


def per_round(levels: list[dict]) -> list[dict]:
    rounds = sorted({int(lv["label"].rsplit("-", 1)[1]) for lv in levels})
    out = []
    for number in rounds:
        mine = [lv for lv in levels if lv["label"].rsplit("-", 1)[1] == str(number)]
        out.append({"round": number, **ratios(summarize_sides(mine))})
    return out


def checks(measured: dict[str, float | None]) -> dict[str, dict]:
    """Each target's value and whether it is met (None: a side was not run)."""
    def met(value: float | None, op: str, bound: float) -> bool | None:
        return None if value is None else (value >= bound if op == ">=" else value <= bound)

    return {name: {"value": measured[name], "target": f"{op} {bound}", "met": met(measured[name], op, bound)}
            for name, (op, bound) in TARGETS.items()}


def in_process(index: str, texts: list[str], k: int, params: dict) -> dict:
    """The floor: the model and the merged index in this process, one thread, no HTTP: milliseconds
    per text embedded alone and in batches of 16 (the model's runs, shardserve.embed.model.plan_runs),
    and per search of the merged index."""
    import faiss

    from loadtests.text_monolith import load_text_searcher

    faiss.omp_set_num_threads(1)
    searcher, _, _ = load_text_searcher(index)
    searcher.embed(texts[:4])
    start = time.perf_counter()
    vectors = np.vstack([searcher.embed([text]) for text in texts])
    alone = time.perf_counter() - start
    start = time.perf_counter()
    for row in range(0, len(texts), 16):
        searcher.embed(texts[row:row + 16])
    batched = time.perf_counter() - start
    start = time.perf_counter()
    for row in range(len(vectors)):
        searcher.searcher.search(vectors[row:row + 1], k, params, prepared=True)
    search = time.perf_counter() - start
    return {"texts": len(texts), "embed_ms_per_text_alone": round(1000 * alone / len(texts), 3),
            "embed_ms_per_text_batched16": round(1000 * batched / len(texts), 3),
            "search_ms_per_query": round(1000 * search / len(texts), 3), "threads": 1}


# --- the index -----------------------------------------------------------------------------------

def build_text_index(work: Path, docs: list[str], shards: int, factory: str) -> Path:
    """The corpus as a .txt file, one text a line, indexed by `shardserve build` as a user runs it
    (kept under --work and reused while it holds this corpus)."""
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location

    corpus = work / "corpus.txt"
    index = work / f"text-{factory.replace(',', '-').lower()}-{shards}-{len(docs)}"
    content = "\n".join(docs) + "\n"
    fresh = corpus.exists() and corpus.read_text() == content
    if fresh and (index / "manifest.json").exists():
        manifest = read_manifest(Location.parse(str(index)))
        if manifest.num_vectors == len(docs) and manifest.embedder is not None:
            return index
    corpus.write_text(content)
    exe = Path(sys.executable).parent / "shardserve"
    command = [str(exe), "build", "--dataset", str(corpus), "--text-column", "text", "--embedder", MODEL,
               "--shards", str(shards), "--index", factory, "--out", str(index)]
    if index.exists():
        command.append("--force")
    print(" ".join(command), flush=True)
    started = time.monotonic()
    if subprocess.run(command).returncode != 0:
        raise SystemExit("the text build failed (see above): `shardserve build --text-column "
                         "--embedder` must be available")
    print(f"  built in {time.monotonic() - started:.0f} s", flush=True)
    return index


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--docs", type=int, default=8000, help="fortunes indexed (the first ones)")
    cli.add_argument("--shards", type=int, default=2)
    cli.add_argument("--factory", default="Flat", help="FAISS factory of the built index")
    cli.add_argument("--index", help="an existing text index directory instead of building one (its "
                                     "corpus must be the first --docs fortunes)")
    cli.add_argument("--k", type=int, default=10)
    cli.add_argument("--nprobe", type=int, help="params.nprobe of every request (IVF indexes)")
    cli.add_argument("--duration", type=float, default=15.0, help="seconds per load level")
    cli.add_argument("--rounds", type=int, default=2, help="rounds of every side, alternating")
    cli.add_argument("--max-qps", type=float, default=500.0 * len(os.sched_getaffinity(0)),
                     help="no level is expected faster: each unique level gets this x --duration texts")
    cli.add_argument("--zipf-texts", type=int, default=2000)
    cli.add_argument("--zipf-exponent", type=float, default=1.1)
    cli.add_argument("--only", choices=("all", "monolith"), default="all",
                     help="`monolith`: its side alone (no ratios): checks the harness without the server")
    cli.add_argument("--work", help="keep the corpus, index and targets here (default: a temp dir)")
    cli.add_argument("--name", help="record name (default: bench-text, bench-text-monolith with --only)")
    cli.add_argument("--out", default=str(RECORDS), help="where the record goes")
    args = cli.parse_args()
    vegeta()  # built, or say what to run before anything starts
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()  # before ray.serve is imported anywhere in this process
    from shardserve.embed.text_data import real_texts
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location

    started = time.monotonic()
    only_monolith = args.only == "monolith"
    texts = real_texts(source="fortunes")
    docs, not_indexed = texts[:args.docs], texts[args.docs:]
    per_level = math.ceil(args.max_qps * args.duration)
    queries = query_sets(not_indexed, per_level, math.ceil(200 * WARM_S), args.zipf_texts,
                         args.zipf_exponent)
    params = {"nprobe": args.nprobe} if args.nprobe else {}
    with work_dir(args.work, "bench-text-") as work:
        work.mkdir(parents=True, exist_ok=True)
        index = os.path.abspath(args.index) if args.index else str(build_text_index(
            work, docs, args.shards, args.factory))
        manifest = read_manifest(Location.parse(index))
        if manifest.embedder is None:
            raise SystemExit(f"{index} was not built from text (its manifest names no embedder)")
        if manifest.num_vectors != len(docs):
            raise SystemExit(f"{index} holds {manifest.num_vectors} texts, not the first --docs "
                             f"{len(docs)} fortunes: the queries would not be the texts it does not hold")
        print("in-process floor (the model and the merged index, one thread)", flush=True)
        limit = in_process(index, queries.warm[:200], args.k, params)
        print(f"  {limit}", flush=True)
        bench = TextBench(queries, args.k, params, args.duration, work)
        for number in range(args.rounds):
            print(f"round {number + 1} of {args.rounds}", flush=True)
            run_round(bench, index, number, only_monolith)
    summary = summarize_sides(bench.levels)
    measured = ratios(summary)
    checked = checks(measured)
    sent = {kind: max((lv["requests"] for lv in bench.levels if lv["texts"] == kind), default=0)
            for kind in ("unique-c32", "unique-c1", "zipf")}
    record = new_record(
        args.name or ("bench-text-monolith" if only_monolith else "bench-text"), bench.levels,
        {"version": manifest.index_version, "factory": manifest.index_factory,
         "shards": len(manifest.shards), "num_vectors": manifest.num_vectors, "metric": manifest.metric,
         "embedder": manifest.embedder.name, "embedder_sha256": manifest.embedder.sha256[:12],
         "params": params, "k": args.k},
        corpus={"source": "Debian fortunes (shardserve.embed.text_data.real_texts)", "docs": len(docs)},
        queries={"unique_pool": queries.unique_pool, "unique_variants": "'<n>. <fortune>' past the pool",
                 "texts_per_unique_level": per_level, "zipf_texts": queries.zipf_texts,
                 "zipf_exponent": args.zipf_exponent, "seed": SEED,
                 "sent": {kind: token_stats(queries.of(kind)[:count]) for kind, count in sent.items()}},
        sides={MONOLITH: f"loadtests/text_monolith.py, {len(os.sched_getaffinity(0))} workers, no cache",
               MONOLITH_LRU: f"the same with --cache-entries {MONOLITH_LRU_ENTRIES} (an LRU per worker)",
               SERVED: "shardserve serve INDEX (defaults: edge, embedding cache)",
               SERVED_NO_CACHE: f"shardserve serve INDEX --arg {NO_CACHE_ARG}"},
        baselines={"in_process": limit}, headline=summary, ratios=checked,
        informational={name: value for name, value in measured.items() if name not in TARGETS},
        per_round=per_round(bench.levels), idle_percent_of_a_core=bench.idle, rounds=args.rounds,
        wall_s=round(time.monotonic() - started, 1),
        not_covered=["batches of texts (`texts`)", "filters and include on text queries",
                     "texts longer than the model's 256 tokens", "open-loop overload", "multi-node"])
    record.pop("knee", None)  # new_record's knee of every level together: these are different systems
    path = save(record, Path(args.out))
    print("\nside                  level       qps    p50 ms   p99 ms  CPU ms/req  success")
    for side, by_level in summary.items():
        for level, figures in by_level.items():
            print(f"{side:<21} {level:<10} {figures['qps']:>6} {figures['p50_ms']:>8} {figures['p99_ms']:>8} "
                  f"{figures['cpu_ms_per_request']:>10}  {figures['success']}")
    print("\nratio                                   value   target   met")
    for name, check in checked.items():
        print(f"{name:<38} {check['value']!s:>7}   {check['target']:<7}  {check['met']}")
    print(f"record: {path} ({record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
