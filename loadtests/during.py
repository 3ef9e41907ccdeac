"""A bounded open-loop vegeta load running while something happens (an index swap, a node kill),
and a per-request account of it: every status code, every answer's index version and coverage.

python -m loadtests.during --url http://127.0.0.1:8000 --new-index DIR [--rate 150] [--out records/]
runs `shardserve swap` under load (the server must be running on this machine's Ray, e.g. `make
demo`, whose Ray counts room for the second version) → swap-under-load.json.

"0 errors" alone says little: the tally also states what it did not see (requests vegeta never sent
are not counted; the load is one rate, one query shape, loopback only).
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from loadtests.record import RECORDS, header, index_info, save
from loadtests.report import parse_timestamp
from loadtests.vegeta_run import assert_loopback, attack_flags, decode, make_targets, vegeta, write_targets
from shardserve.data.datasets import load_dataset


class BackgroundLoad:
    """`with BackgroundLoad(...) as load: <event>`; then `load.results()` → decoded vegeta hits."""

    def __init__(self, url: str | list[str], queries, rate: float, duration_s: float, work: Path,
                 params: dict | None = None, timeout_s: float = 10.0):
        """`url`: one, or several (edges: the targets alternate between them, so each gets an
        equal share of the rate)."""
        urls = [url] if isinstance(url, str) else list(url)
        for each in urls:
            assert_loopback(each)
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        per_url = [make_targets(queries, each, 10, params, count=1000) for each in urls]
        self.targets = write_targets(work / "targets.jsonl",
                                     [line for lines in zip(*per_url, strict=True) for line in lines])
        self.output = work / "results.bin"
        self.flags = [*attack_flags(self.targets, duration_s, rate=rate, timeout_s=timeout_s,
                                    max_workers=256), f"-output={self.output}"]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> BackgroundLoad:
        self.process = subprocess.Popen([vegeta(), "attack", *self.flags])
        try:
            self.process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return self  # running
        raise RuntimeError(f"vegeta attack exited at once (code {self.process.returncode}): {self.flags}")

    def __exit__(self, *exc) -> None:
        assert self.process is not None
        if exc[0] is not None:  # the event failed: do not wait out the load
            self.process.terminate()
        self.process.wait(timeout=600)

    def results(self) -> list[dict]:
        return decode(self.output)


class ReplicaWatcher:
    """`with ReplicaWatcher(app) as watcher: <load>`; then `watcher.samples`: RUNNING replicas of
    each shard deployment, once per `period_s`, as {"t": wall-clock s, "replicas": {name: n}} (or
    {"t", "error"} when Serve's status was not readable at that instant)."""

    def __init__(self, app: str, period_s: float = 1.0, router: bool = False):
        """`router`: the router's replicas too, as "Router"."""
        self.app, self.period_s, self.router = app, period_s, router
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="replica-watcher", daemon=True)

    def __enter__(self) -> ReplicaWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        from deployments.run import router_replicas, shard_replicas

        while not self._stop.is_set():
            started = time.time()
            try:
                replicas = shard_replicas(self.app)
                if self.router:
                    replicas["Router"] = router_replicas(self.app)
                self.samples.append({"t": started, "replicas": replicas})
            except Exception as exc:  # keep watching through transient controller hiccups
                self.samples.append({"t": started, "error": type(exc).__name__})
            self._stop.wait(max(0.0, self.period_s - (time.time() - started)))


def tally(hits: list[dict], events: dict[str, float] | None = None) -> dict:
    """Status codes, versions and coverage over all requests, plus a per-second timeline keyed by
    when each answer ARRIVED (send time + latency), with the slowest answer of each second.

    `events`: name → wall-clock seconds (time.time()) of what happened during the load.
    """
    codes: Counter[str] = Counter()
    versions: Counter[str] = Counter()
    coverage: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    timeline: dict[int, Counter] = {}
    start = min((parse_timestamp(h["timestamp"]) for h in hits), default=0.0)
    for hit in hits:
        code = str(hit["code"])
        codes[code] += 1
        if hit.get("error"):
            errors[hit["error"][:120]] += 1
        second = int(parse_timestamp(hit["timestamp"]) + hit["latency"] / 1e9 - start)
        slot = timeline.setdefault(second, Counter())
        slot[code] += 1
        slot["max_ms"] = max(slot["max_ms"], round(hit["latency"] / 1e6))
        if hit["code"] != 200:
            continue
        payload = json.loads(base64.b64decode(hit["body"]))
        versions[payload["index"]] += 1
        cov = payload["coverage"]
        full = cov["answered"] == cov["shards"]
        coverage["full" if full else "partial"] += 1
        slot["partial" if not full else "full"] += 1
        slot[f"v:{payload['index'][:8]}"] += 1
    return {
        "requests": len(hits), "status_codes": dict(codes),
        "non_2xx": sum(n for c, n in codes.items() if not c.startswith("2")),
        "lost": codes.get("0", 0),  # vegeta code 0: no HTTP answer (timeout, connection error)
        "index_versions": dict(versions), "coverage": dict(coverage),
        "errors": dict(errors.most_common(5)),
        "events_s": {name: round(t - start, 2) for name, t in (events or {}).items()},
        "timeline": [{"second": s, **dict(timeline[s])} for s in sorted(timeline)],
    }


def swap_under_load(url: str, new_index: str, rate: float = 100.0, duration_s: float = 20.0,
                    lead_s: float = 3.0, params: dict | None = None, **swap_options) -> dict:
    """Start the load, swap `lead_s` seconds into it, let the load finish; tally every request."""
    from deployments.swap import swap_index

    before = index_info(url)
    queries = load_dataset("fashion-mnist", num_queries=1000).queries
    events: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as work:
        load = BackgroundLoad(url, queries, rate, duration_s, Path(work), params)
        with load:
            time.sleep(lead_s)
            events["swap_started"] = time.time()
            report = swap_index(new_index, **swap_options)
            events["swap_done"] = time.time()
        hits = load.results()
    return {**header("swap-under-load"), "index_before": before, "index_after": index_info(url),
            "load": {"rate": rate, "duration_s": duration_s, "params": params or {},
                     "not_covered": "one open-loop rate, single-vector queries, loopback only; "
                                    "requests refused before vegeta sent them are not counted"},
            "swap": report, "result": tally(hits, events)}


def main() -> None:
    from shardserve.runtime.ray_session import apply_serving_node_env

    apply_serving_node_env()
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--url", default="http://127.0.0.1:8000")
    cli.add_argument("--new-index", required=True)
    cli.add_argument("--rate", type=float, default=100.0)
    cli.add_argument("--duration", type=float, default=20.0)
    cli.add_argument("--nprobe", type=int, default=16)
    cli.add_argument("--out", default=str(RECORDS))
    args = cli.parse_args()
    vegeta()  # built, or say what to run before anything starts
    import ray

    ray.init(address="auto", log_to_driver=False)
    record = swap_under_load(args.url, args.new_index, args.rate, args.duration,
                             params={"nprobe": args.nprobe})
    out = save(record, Path(args.out))
    result = record["result"]
    print(f"{out}: {result['requests']} requests, status {result['status_codes']}, "
          f"versions {result['index_versions']}, non-2xx {result['non_2xx']}")


if __name__ == "__main__":
    main()
