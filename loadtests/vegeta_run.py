"""vegeta from Python, the one place its flags are spelled (loadtests/sweep.sh asks this module for
them): targets from real query vectors, a closed-loop or open-loop attack, and its results decoded.

    python -m loadtests.vegeta_run targets --dataset fashion-mnist --url URL --out t.jsonl
    python -m loadtests.vegeta_run flags --targets t.jsonl --duration 10 --mode concurrency --value 32
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import json
import os
import resource
import subprocess
from pathlib import Path
from urllib.parse import urlencode, urlparse

import numpy as np
import orjson

from loadtests.report import summarize
from shardserve.data.datasets import load_dataset
from shardserve.query.parse import NPY_CONTENT_TYPE, npy_body
from shardserve.runtime.procfs import SELF_CLASS, CpuMeter

ROOT = Path(__file__).resolve().parent.parent
VEGETA = Path(os.environ.get("VEGETA", ROOT / ".bin" / "vegeta"))


def vegeta() -> str:
    """The vegeta binary; when it is not built yet, one line that says what to run (harnesses call
    this first, before they start anything)."""
    if not (VEGETA.is_file() and os.access(VEGETA, os.X_OK)):
        raise SystemExit(f"vegeta not found at {VEGETA}: run `make vegeta` first (or set VEGETA to a "
                         "vegeta v12 binary)")
    return str(VEGETA)


def assert_loopback(url: str) -> None:
    """Load tests target this machine only (loopback), never another host."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"refusing to load-test {url}: only loopback targets (127.0.0.0/8, ::1) are allowed")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def vegeta_version() -> str:
    out = subprocess.run([vegeta(), "-version"], capture_output=True, text=True, check=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Version")),
                "unknown")


def make_targets(queries: np.ndarray, url: str, k: int = 10, params: dict | None = None,
                 batch: int = 0, count: int = 1000, npy: bool = False,
                 extra: dict | None = None, route: str = "/v1/search") -> list[bytes]:
    """One vegeta JSON target per line; bodies cycle through the real queries (base64-encoded).
    `npy`: float32 .npy bodies with k and params in the query string, instead of JSON bodies.
    `extra`: more fields of every JSON body (e.g. a `filter`). `route`: the search's path under `url`
    (a collection's: /v1/collections/NAME/search)."""
    lines = []
    endpoint = url.rstrip("/") + route
    for i in range(count):
        rows = np.arange(i * batch, (i + 1) * batch) % len(queries) if batch else i % len(queries)
        if npy:
            raw, kind = npy_body(queries[rows]), NPY_CONTENT_TYPE
            target = f"{endpoint}?{urlencode({'k': k, **(params or {})})}"
        else:
            body: dict = {"vectors" if batch else "vector": queries[rows], "k": k}
            if params:
                body["params"] = params
            body.update(extra or {})
            raw, kind = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), "application/json"
            target = endpoint
        lines.append(orjson.dumps({"method": "POST", "url": target, "header": {"Content-Type": [kind]},
                                   "body": base64.b64encode(raw).decode()}))
    return lines


def text_targets(texts: list[str], url: str, k: int = 10, params: dict | None = None) -> list[bytes]:
    """One vegeta JSON target per text (`{"text": ..., "k": ...}`), each text once: vegeta cycles
    through its targets, so a run sends a text twice (a cache hit) only past len(texts) requests."""
    endpoint = url.rstrip("/") + "/v1/search"
    lines = []
    for text in texts:
        body = orjson.dumps({"text": text, "k": k, **({"params": params} if params else {})})
        lines.append(orjson.dumps({"method": "POST", "url": endpoint,
                                   "header": {"Content-Type": ["application/json"]},
                                   "body": base64.b64encode(body).decode()}))
    return lines


def write_targets(path: Path, lines: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def attack_flags(targets: Path, duration_s: float, *, rate: float | None = None,
                 concurrency: int | None = None, timeout_s: float = 10.0,
                 max_workers: int = 1024) -> list[str]:
    """`vegeta attack` flags: open loop at `rate` req/s, or closed loop with `concurrency` workers
    (rate=0: each worker sends its next request when the last one is answered)."""
    flags = [f"-duration={duration_s:g}s", f"-timeout={timeout_s:g}s", "-format=json", f"-targets={targets}",
             "-keepalive=true", "-http2=false"]
    if concurrency is not None:
        return [*flags, "-rate=0", f"-workers={int(concurrency)}", f"-max-workers={int(concurrency)}"]
    return [*flags, f"-rate={rate:g}/s", "-workers=16", f"-max-workers={max_workers}"]


def decode(results: Path) -> list[dict]:
    """Every request of a vegeta results file (`vegeta encode --to json`), as dicts."""
    encoded = subprocess.run([vegeta(), "encode", "--to", "json", str(results)], capture_output=True,
                             text=True, check=True).stdout
    return [json.loads(line) for line in encoded.splitlines() if line.strip()]


BESIDE = "load generator beside"  # another attack running through this one's window
NOT_SERVERS = ("load generator", BESIDE, SELF_CLASS)  # the attacks' own processes, not the system's


def machine_share(machine: dict[str, float], accounted_s: float) -> dict[str, float]:
    """The whole machine over a level, in % of its cores: `busy`, `idle` (no process had work:
    a closed loop waiting on hand-offs, not on CPU), and `busy_unaccounted` (busy, but in no
    measured process: kernel threads, processes that exited inside the window)."""
    total = machine["busy"] + machine["idle"]
    if total <= 0:
        return {}
    return {"busy_percent": round(100 * machine["busy"] / total, 1),
            "idle_percent": round(100 * machine["idle"] / total, 1),
            "busy_unaccounted_percent": round(100 * (machine["busy"] - accounted_s) / total, 1)}


def attack(targets: Path, mode: str, value: float, duration_s: float, out_dir: Path, label: str,
           queries_per_request: int = 1, timeout_s: float = 10.0, meter: CpuMeter | None = None) -> dict:
    """One bounded level: closed loop (`concurrency`) or open loop (`rate`) → a records level.

    With a `meter`, the level also carries `cpu_ms_per_request` by process class over the attack.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / f"{label}.bin"
    flags = (attack_flags(targets, duration_s, concurrency=int(value), timeout_s=timeout_s)
             if mode == "concurrency" else attack_flags(targets, duration_s, rate=value, timeout_s=timeout_s))
    if meter is not None:
        meter.start()
    children_before = _children_cpu_s()
    with results.open("wb") as sink:
        subprocess.run([vegeta(), "attack", *flags], stdout=sink, check=True)
    cpu = meter.stop() if meter is not None else None
    if cpu is not None:  # vegeta has exited by now: its CPU is in our children's rusage, not /proc
        beside = cpu.pop("load generator", 0.0)  # one still running: another attack's (an ingest beside)
        cpu["load generator"] = _children_cpu_s() - children_before
        if beside:
            cpu[BESIDE] = beside
    encoded = subprocess.run([vegeta(), "encode", "--to", "json", str(results)], capture_output=True,
                             text=True, check=True).stdout
    level = summarize(encoded.splitlines(), mode, value, duration_s, queries_per_request)
    level["label"] = label
    if cpu is not None and level["requests"]:
        per_request = {name: round(seconds * 1000 / level["requests"], 3) for name, seconds in cpu.items()}
        per_request["total (servers)"] = round(sum(
            v for name, v in per_request.items() if name not in NOT_SERVERS), 3)
        level["cpu_ms_per_request"] = dict(sorted(per_request.items()))
        level["machine_cpu"] = machine_share(meter.machine, sum(cpu.values())) if meter else {}
    results.unlink()  # the record keeps the summary; raw results are large
    return level


def main() -> None:
    """`targets`: write vegeta JSON targets from a dataset's queries. `flags`: print the attack flags,
    one per line, for loadtests/sweep.sh, so they are spelled in one place."""
    cli = argparse.ArgumentParser(description=main.__doc__)
    sub = cli.add_subparsers(dest="what", required=True)
    targets = sub.add_parser("targets")
    targets.add_argument("--dataset", default="fashion-mnist")
    targets.add_argument("--url", default="http://127.0.0.1:8000")
    targets.add_argument("--k", type=int, default=10)
    targets.add_argument("--nprobe", type=int)
    targets.add_argument("--ef-search", type=int)
    targets.add_argument("--batch", type=int, default=0, help="vectors per request (0 = single `vector`)")
    targets.add_argument("--count", type=int, default=1000, help="distinct bodies")
    targets.add_argument("--npy", action="store_true", help=".npy bodies (k, params in the query string)")
    targets.add_argument("--text", action="store_true", help="text bodies: `count` distinct real texts "
                         "(shardserve.embed.text_data), for an index built from text")
    targets.add_argument("--out", required=True)
    flags = sub.add_parser("flags")
    flags.add_argument("--targets", type=Path, required=True)
    flags.add_argument("--duration", type=float, required=True)
    flags.add_argument("--mode", choices=("concurrency", "rate"), required=True)
    flags.add_argument("--value", type=float, required=True)
    args = cli.parse_args()
    if args.what == "targets":
        params = {k: v for k, v in (("nprobe", args.nprobe), ("efSearch", args.ef_search)) if v}
        if args.text:
            from shardserve.embed.text_data import real_texts
            from shardserve.embed.validate import MAX_TEXT_CHARS

            # texts a server takes by default (a few fortunes are longer)
            texts = [t for t in real_texts(args.count + args.count // 10) if len(t) <= MAX_TEXT_CHARS]
            texts = texts[:args.count]
            print(write_targets(Path(args.out), text_targets(texts, args.url, args.k, params)))
            return
        queries = load_dataset(args.dataset).queries
        print(write_targets(Path(args.out), make_targets(queries, args.url, args.k, params, args.batch,
                                                          args.count, args.npy)))
        return
    chosen = (attack_flags(args.targets, args.duration, concurrency=int(args.value))
              if args.mode == "concurrency" else attack_flags(args.targets, args.duration, rate=args.value))
    print("\n".join(chosen))


if __name__ == "__main__":
    main()
