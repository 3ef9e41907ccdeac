"""Chroma's own test suite, from the pinned `chromadb` wheel, against `shardserve serve`
(`make test-chroma`): the way Chroma's CI runs it against a remote server.

Two runs, each on a fresh `shardserve serve`: as users run it (a Chroma collection is one exact
shard below `chroma_grow_at`, 20,000 records, which the suite's collections stay under), then with
each collection's writes folded into a new version every few hundred operations (a compaction and a
move of every replica to it while the suite writes and reads) and, past 1,000 records, grown into
its 2 shards (`grown` counts those growths). What the wheel
skips by itself is listed with its own reason; what is not run here is DESELECTED, each with why.
The result is loadtests/records/chroma-suite.json; the command fails when any test fails.

    python -m loadtests.chroma_suite [--preset fast|normal] [--only property/test_add.py]
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx

from loadtests.record import RECORDS, header, save
from loadtests.served import Server, wait_for
from shardserve.runtime.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / ".venv-peer"
CHROMA_VERSION = "1.5.9"
SUITE = ["property/test_add.py", "property/test_embeddings.py", "property/test_filtering.py",
         "property/test_collections.py", "property/test_collections_with_database_tenant.py",
         "property/test_base64_conversion.py", "property/test_client_url.py", "api/"]
# Not run here, and why (nothing is left out to make the run green: each is a feature not served,
# or a test that does not talk to a remote server).
DESELECTED = {
    "api/test_schema_e2e.py": "Chroma 1.x's collection schema (per-key index settings, full-text and "
                              "sparse indexes) is not served: collections answer `schema: null`",
    "api/test_delete_database.py::test_collection_was_removed": "reads an in-process Chroma's SQLite "
                                                                "(fixture python_sqlite_persistent)",
}
RUNS = {"default": (), "folds": ("--arg", "collection_compact_at=300", "--arg", "chroma_grow_at=1000")}
# the folds run: the tests that write and read records (collections' and tenants' own do neither)
FOLDED = ["property/test_add.py", "property/test_embeddings.py", "property/test_filtering.py"]


def _peer_site() -> Path:
    [site] = (PEER / "lib").glob("python3*/site-packages")
    return site / "chromadb" / "test"


def run_suite(url_port: int, tests: list[str], preset: str, junit: Path, seed: int) -> int:
    env = {**os.environ, "CHROMA_INTEGRATION_TEST_ONLY": "1", "CHROMA_SERVER_HOST": "localhost",
           "CHROMA_SERVER_HTTP_PORT": str(url_port), "PROPERTY_TESTING_PRESET": preset}
    deselect = ["-k", " and ".join(f"not {test.split('::')[1]}" for test in DESELECTED if "::" in test)]
    ignore = [arg for test in DESELECTED if "::" not in test for arg in ("--ignore", test)]
    command = [str(PEER / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
               "-rfE", f"--junitxml={junit}", f"--hypothesis-seed={seed}", *deselect, *ignore, *tests]
    return subprocess.run(command, cwd=_peer_site(), env=env, check=False).returncode


def results(junit: Path) -> dict:
    """Counts, and each failure and skip with its message, from pytest's JUnit XML."""
    out: dict = {"passed": 0, "failed": [], "skipped": {}}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            out["failed"].append({"test": name, "message": (failed.get("message") or "")[:300]})
        elif skipped is not None:
            reason = (skipped.get("message") or "").strip()[:200]
            out["skipped"][reason] = out["skipped"].get(reason, 0) + 1
        else:
            out["passed"] += 1
    return out


def killed_writes(index: Path, workdir: Path) -> dict:
    """Chroma's client adding batches while every process of the server is SIGKILLed; then the
    server started again on the same directory, and every batch the client saw succeed read back
    whole (loadtests/chroma_writer.py, run by Chroma's own Python)."""
    acked = workdir / "acked.txt"
    writer_script = str(ROOT / "loadtests" / "chroma_writer.py")
    server = Server(index, free_port(), log=workdir / "serve-killed.log", flags=("--num-cpus", "2"))
    try:
        server.wait_said("Ctrl-C stops it.", 0)
        wait_for(functools.partial(_beats, server.url), "Chroma's heartbeat", timeout_s=60)
        writer = subprocess.Popen([str(PEER / "bin" / "python"), writer_script, str(server.port), str(acked)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: acked.exists() and len(acked.read_text().splitlines()) >= 20,
                     "1,000 acknowledged records", timeout_s=300, process=writer)
            killed = server.kill_all()
        finally:
            writer.kill()
            writer.wait()
    finally:
        server.stop()
    acknowledged = sum(int(b) - int(a) for a, b in (line.split() for line in acked.read_text().splitlines()))
    again = Server(index, free_port(), log=workdir / "serve-restarted.log", flags=("--num-cpus", "2"))
    try:
        again.wait_said("Ctrl-C stops it.", 0)
        wait_for(functools.partial(_beats, again.url), "Chroma's heartbeat", timeout_s=60)
        checked = subprocess.run([str(PEER / "bin" / "python"), writer_script, "check", str(again.port),
                                  str(acked)], capture_output=True, text=True, check=False)
    finally:
        again.stop()
    print(f"chroma SIGKILL: {killed} processes killed after {acknowledged} acknowledged records; "
          f"after the restart: {(checked.stdout or checked.stderr).strip()}", flush=True)
    return {"processes_killed": killed, "acknowledged_records": acknowledged,
            "all_found": checked.returncode == 0, "said": (checked.stdout or checked.stderr).strip()[-300:]}


def _index(workdir: Path) -> Path:
    from index_build.job import build_index

    index = workdir / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=2000, backend="local")
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="fast", choices=["fast", "normal"],
                        help="Hypothesis examples per property (Chroma's PROPERTY_TESTING_PRESET)")
    parser.add_argument("--seed", type=int, default=68, help="Hypothesis's seed: the same examples every run "
                                                            "(a red run is reproduced by its seed)")
    parser.add_argument("--only", action="append", help="a test path under chromadb/test (repeatable)")
    parser.add_argument("--runs", default="default,folds,killed",
                        help="default, folds (the suite), killed (SIGKILL of the server under Chroma's adds)")
    parser.add_argument("--out", default=str(RECORDS), help="where chroma-suite.json goes (a run of --only "
                                                          "or of one run writes none)")
    args = parser.parse_args(argv)
    tests = args.only or SUITE
    record = header("chroma-suite", tool=None, chromadb=CHROMA_VERSION, preset=args.preset, seed=args.seed,
                    tests=tests,
                    deselected=DESELECTED, runs={})
    failed = False
    with tempfile.TemporaryDirectory(prefix="chroma-suite-") as work:
        workdir = Path(work)
        index = _index(workdir)
        for run in [r for r in args.runs.split(",") if r in RUNS]:
            port = free_port()
            flags = ("--num-cpus", "2", "--arg", "chroma_allow_reset=true", *RUNS[run])
            server = Server(index, port, log=workdir / f"serve-{run}.log", flags=flags)
            try:
                server.wait_said("Ctrl-C stops it.", 0)
                wait_for(functools.partial(_beats, server.url), "Chroma's heartbeat", timeout_s=60)
                started = time.monotonic()
                chosen = tests if args.only or run == "default" else FOLDED
                code = run_suite(port, chosen, args.preset, workdir / f"{run}.xml", args.seed)
                counted = results(workdir / f"{run}.xml")
                counted["seconds"] = round(time.monotonic() - started, 1)
                counted["server_flags"], counted["tests"] = list(flags), chosen
                counted["folds"] = server.said("shardserve: collection 'chroma-")  # folded while tested
                counted["grown"] = server.said("' grown into ")  # of them, grown into its shards
                record["runs"][run] = counted
                print(f"chroma suite ({run}): {counted['passed']} passed, {len(counted['failed'])} failed, "
                      f"{sum(counted['skipped'].values())} skipped by the wheel, {counted['folds']} folds, "
                      f"{counted['grown']} grown",
                      flush=True)
                failed = failed or code != 0 or bool(counted["failed"])
            finally:
                server.stop()
        if "killed" in args.runs.split(","):
            record["killed"] = killed = killed_writes(index, workdir)
            failed = failed or not killed["all_found"]
    if not args.only and len(record["runs"]) == len(RUNS) and "killed" in record:
        print(f"record: {save(record, Path(args.out), plot_levels=False)}")
    return 1 if failed else 0


def _beats(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/v2/heartbeat", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
