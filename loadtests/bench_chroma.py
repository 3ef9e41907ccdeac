"""`make bench-chroma`: the same `chromadb.HttpClient` code (loadtests/chroma_compare.py, run by
Chroma's own Python) against Chroma's server (`chroma run`, .venv-peer) and against `shardserve
serve`, one after the other on this machine, on Fashion-MNIST's 60,000 x 784 vectors with their
labels as metadata:

- identity: 1,000 test queries, each filtered to a label (`where={"label": l}`), n_results 10, on
  indexes as exact as each can be made through Chroma's API: Chroma's HNSW with ef_search 1,000
  (its collection configuration), shardserve's collection kept exact (`--arg chroma_grow_at`,
  which the record names: a 60K collection grows into an IVF index by default);
- rates at 8 clients: filtered queries, and adds of 10 records, for 20 s each.

    python -m loadtests.bench_chroma --index DIR -> loadtests/records/bench-chroma.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from loadtests.bench_writes import PEER
from loadtests.record import RECORDS, header, save
from loadtests.served import Server, wait_for
from shardserve.data.datasets import load_dataset
from shardserve.runtime.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "loadtests" / "chroma_compare.py"
EXACT_GROW_AT = 1_000_000  # shardserve's Chroma collections stay exact (flat) below this


def _export(work: Path, queries: int) -> Path:
    data = load_dataset("fashion-mnist")
    out = work / "data"
    out.mkdir()
    np.save(out / "base.npy", data.base.astype(np.float32))
    np.save(out / "labels.npy", np.asarray(data.metadata.column("label").to_numpy(), np.int64))
    np.save(out / "queries.npy", data.queries[:queries].astype(np.float32))
    np.save(out / "query_labels.npy", np.random.default_rng(1).integers(0, 10, queries))
    return out


def _measure(port: int, data: Path, clients: int, seconds: float) -> dict:
    done = subprocess.run([str(PEER.parent / "python"), str(SCRIPT), str(port), str(data), "--clients",
                           str(clients), "--seconds", str(seconds)], capture_output=True, text=True,
                          check=False, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the Chroma client failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _chroma(work: Path, data: Path, clients: int, seconds: float) -> dict:
    import os

    import httpx

    port = free_port()
    with (work / "chroma.log").open("w") as log:
        process = subprocess.Popen([str(PEER), "run", "--path", str(work / "chroma"), "--host", "127.0.0.1",
                                    "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "ANONYMIZED_TELEMETRY": "False"})
        try:
            def up() -> bool:
                try:
                    beat = httpx.get(f"http://127.0.0.1:{port}/api/v2/heartbeat", timeout=2)
                    return beat.status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(up, "Chroma's server", timeout_s=120, process=process)
            return _measure(port, data, clients, seconds)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _shardserve(index: Path, work: Path, data: Path, clients: int, seconds: float) -> dict:
    server = Server(index, free_port(), log=work / "serve.log",
                    flags=("--arg", f"chroma_grow_at={EXACT_GROW_AT}"))
    try:
        server.wait_said("Ctrl-C stops it.", 0)
        return _measure(server.port, data, clients, seconds)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", required=True, help="the index `shardserve serve` serves beside")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--queries", type=int, default=1000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-chroma-") as tmp:
        work = Path(tmp)
        data = _export(work, args.queries)
        import shutil

        copy = work / "index"
        shutil.copytree(args.index, copy)  # its collections and log go to the copy
        chroma = _chroma(work, data, args.clients, args.seconds)
        ours = _shardserve(copy, work, data, args.clients, args.seconds)
    same = [a == b for a, b in zip(chroma.pop("ids"), ours.pop("ids"), strict=True)]
    record = header("bench-chroma", tool={"name": "chromadb.HttpClient", "version": "1.5.9"},
                    dataset="fashion-mnist (60,000 x 784, label as metadata)", clients=args.clients,
                    seconds=args.seconds, shardserve_flags=["--arg", f"chroma_grow_at={EXACT_GROW_AT}"],
                    chroma_configuration={"hnsw": {"space": "l2", "ef_search": 1000, "ef_construction": 400,
                                                   "max_neighbors": 32}},
                    identical_ids={"queries": len(same), "identical": sum(same),
                                   "share": round(sum(same) / len(same), 4)},
                    chroma=chroma, shardserve=ours,
                    ratios={"query": round(ours["query"]["per_s"] / chroma["query"]["per_s"], 2),
                            "add": round(ours["add"]["per_s"] / chroma["add"]["per_s"], 2),
                            "load": round(chroma["load_s"] / ours["load_s"], 2)})
    print(json.dumps({k: record[k] for k in ("identical_ids", "ratios")}))
    print(f"record: {save(record, RECORDS, plot_levels=False)}")


if __name__ == "__main__":
    main()
