"""Real multi-node Ray on one machine (head + 2 worker raylets via `ray start`): shards placed on
the workers, answers equal single-node ones, a worker killed under vegeta load loses no request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from index_build.job import build_index
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.ha]  # in make test-ha, beside the loss of the head


def test_worker_node_killed_under_load(tmp_path: Path) -> None:
    index = tmp_path / "idx"
    temp_dirs = set(Path("/tmp").glob("rmn*"))  # LocalCluster's (loadtests.local_cluster)
    build_index("fashion-mnist", 4, "IVF64,Flat", str(index), limit=8000, backend="local")
    # Its own driver process: this test session may already be connected to another Ray.
    done = subprocess.run([sys.executable, "-m", "loadtests.node_kill", "--index", str(index),
                           "--rate", "60", "--duration", "25", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(Path("/tmp").glob("rmn*")) <= temp_dirs, "the cluster's temp dir was left behind"
    record = json.loads((tmp_path / "node-kill.json").read_text())
    assert record["answers_equal_single_node"]
    before = record["placement_before"]
    assert set(before.values()) == {"node_w1", "node_w2"}  # shards spread over both workers
    assert set(record["placement_after"].values()) == {"node_w1"}  # the lost ones restarted there
    result = record["result"]
    assert result["lost"] == 0 and set(result["status_codes"]) <= {"200", "503"}, result
    assert result["requests"] >= 60 * 25 * 0.95
    assert result["coverage"].get("partial", 0) > 0  # the outage was seen and flagged
    assert record["restored_s"] is not None  # full answers came back within the run (its timeline below)
    last = result["timeline"][-3:]
    assert all(s.get("full", 0) == s.get("200", 0) > 0 for s in last)
