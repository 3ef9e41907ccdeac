"""`--index auto`: the factory rule on constructed sizes (every choice a factory FAISS builds), and
the CLI end to end on real (synthetic) data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardserve.errors import ShardserveError
from shardserve.index.auto_index import choose_factory, nlist_for, parse_bytes, pq_m_for
from shardserve.index.indexes import make_empty_index
from tests.conftest import run_cli

GiB = 2**30


@pytest.mark.parametrize("n, dim, budget, factory", [
    (5_000, 784, GiB, "Flat"),
    (60_000, 784, GiB, "IVF1024,Flat"),                      # Fashion-MNIST: what the demo builds
    (400_000, 50, GiB, "IVF2048,Flat"),                      # GloVe-50
    (4_000_000, 128, GiB, "IVF8192,PQ32x4fs,Refine(SQ8)"),   # the scale recipe
    (4_000_000, 128, GiB // 4, "IVF8192,PQ32x4fs"),          # only 4-bit codes fit
    (60_000, 784, 64 * 2**20, "IVF1024,PQ196x4fs,Refine(SQ8)"),
])
def test_the_rule_picks_a_factory_faiss_builds(n: int, dim: int, budget: int, factory: str) -> None:
    chosen, why = choose_factory(n, dim, budget)
    assert chosen == factory and why
    make_empty_index(chosen, dim, "l2")


def test_sizes_and_refusals() -> None:
    assert nlist_for(1_000) == 16 and nlist_for(10**9) == 65536
    assert nlist_for(3_000) <= 3_000 // 39
    assert pq_m_for(128) == 32 and pq_m_for(50) == 10
    assert parse_bytes("4GB") == 4 * GiB and parse_bytes("512MiB") == 512 * 2**20
    for bad in ("lots", "-1GB", "0"):
        with pytest.raises(ShardserveError, match="memory-budget"):
            parse_bytes(bad)
    with pytest.raises(ShardserveError, match="too small"):
        choose_factory(10**8, 128, GiB)


def test_cli_builds_with_auto_and_records_why(tmp_path: Path) -> None:
    out = tmp_path / "auto"
    result = run_cli("build", "--dataset", "synthetic:30000x32", "--shards", "2", "--index", "auto",
                     "--memory-budget", "1GB", "--out", str(out), "--backend", "local")
    assert result.returncode == 0, result.stderr
    assert "IVF512,Flat" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["index_factory"] == "IVF512,Flat" and "fit" in manifest["build"]["params"]["auto"]
    for args, message in ((["--memory-budget", "lots"], "cannot read 'lots'"),
                          (["--memory-budget", "1KB"], "too small")):
        failed = run_cli("build", "--dataset", "synthetic:30000x32", "--shards", "2", "--index", "auto",
                         *args, "--out", str(tmp_path / "no"), "--backend", "local")
        assert failed.returncode == 2 and "Traceback" not in failed.stderr and message in failed.stderr
        assert not (tmp_path / "no" / "manifest.json").exists()
