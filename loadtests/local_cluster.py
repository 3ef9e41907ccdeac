"""A real multi-node Ray cluster on one machine: a head and worker raylets started with `ray start`,
the way an on-prem cluster is started, each node with its own resources; nodes can be killed.

Everything it starts lives under its own --temp-dir and ports, so it runs beside another local Ray
(the test session's) and stops only its own processes, found by that temp dir and by parentage.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardserve.runtime import procfs
from shardserve.runtime.ray_session import SERVING_NODE_ENV

RAY = str(Path(sys.executable).parent / "ray")


class LocalCluster:
    """`with LocalCluster(workers=[{"shard_host": 2}, ...]) as cluster:` → cluster.address."""

    def __init__(self, workers: list[dict[str, float]], worker_cpus: float = 2, head_cpus: float = 1,
                 port: int = 26380, port_base: int = 27000, detect_death_s: float = 3.0):
        self.workers = workers
        self.worker_cpus = worker_cpus
        self.head_cpus = head_cpus
        self.port = port
        self.port_base = port_base  # per-node agent/metrics ports: no clash with another local Ray
        self.temp_dir = tempfile.mkdtemp(prefix="rmn", dir="/tmp")  # short: unix socket paths
        self.worker_raylets: list[int] = []
        self.object_store_bytes = 512 * 1024 * 1024  # per node; the default (30% of RAM) x 3 nodes
        period_ms = 500
        self.env = {
            **os.environ, **SERVING_NODE_ENV,
            # one token for every node and driver of this cluster (Ray 2.60 token auth)
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
            # notice a dead node in ~detect_death_s instead of Ray's default ~30 s
            "RAY_health_check_period_ms": str(period_ms),
            "RAY_health_check_timeout_ms": str(period_ms),
            "RAY_health_check_failure_threshold": str(max(1, int(detect_death_s * 1000 / period_ms))),
        }
        self.env.pop("RAY_ADDRESS", None)

    def driver_env(self) -> dict[str, str]:
        """What a driver process needs in its environment to join this cluster."""
        return {k: self.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", *SERVING_NODE_ENV)}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> LocalCluster:
        try:
            self._ray_start("--head", f"--port={self.port}", f"--num-cpus={self.head_cpus}",
                            f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
                            f"--ray-client-server-port={self.port_base + 1}",
                            "--resources", json.dumps({"shardserve_head": 1}), node=0)
            for number, resources in enumerate(self.workers, start=1):
                before = set(self._raylets())
                self._ray_start(f"--address={self.address}", f"--num-cpus={self.worker_cpus}",
                                "--resources", json.dumps(resources), node=number)
                started = set(self._raylets()) - before
                if len(started) != 1:
                    raise RuntimeError(f"could not tell worker {number}'s raylet apart: {started}")
                self.worker_raylets.append(started.pop())
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        """Stop the cluster; its temp dir (session logs) goes too, unless the block failed: then it
        is kept for the logs, and its path printed."""
        self.stop()
        if exc_type is None:
            self.remove_temp_dir()
        else:
            print(f"LocalCluster: logs kept in {self.temp_dir}", file=sys.stderr)

    def kill_worker(self, number: int) -> None:
        """Node failure: SIGKILL worker `number`'s raylet and every process under it, at once."""
        raylet = self.worker_raylets[number - 1]
        for pid in [*procfs.descendants(raylet), raylet]:
            _signal(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Stop every process of this cluster (and nothing else): SIGTERM, then SIGKILL stragglers.
        Again while any is left: a raylet can fork a worker between the listing and its own end."""
        for _ in range(3):
            roots = self._everything_started()
            if not roots:
                return
            victims = set(roots)
            for pid in roots:
                victims.update(procfs.descendants(pid))
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in victims:
                    _signal(pid, sig)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and any(procfs.alive(p) for p in victims):
                    time.sleep(0.2)

    def remove_temp_dir(self, settle_s: float = 1.0, timeout_s: float = 15.0) -> None:
        """Remove the temp dir until it stays gone for `settle_s` (belt and braces: a process of
        the cluster still starting as it stopped could create its session dirs again)."""
        deadline = time.monotonic() + timeout_s
        while True:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            time.sleep(settle_s)
            if not os.path.exists(self.temp_dir) or time.monotonic() > deadline:
                return

    def _ray_start(self, *args: str, node: int) -> None:
        ports = [f"--dashboard-agent-listen-port={self.port_base + 10 + node * 10}",
                 f"--dashboard-agent-grpc-port={self.port_base + 11 + node * 10}",
                 f"--metrics-export-port={self.port_base + 12 + node * 10}",
                 f"--runtime-env-agent-port={self.port_base + 13 + node * 10}"]
        # each node its own HAProxy stats/metrics ports: every node of this cluster is on this machine
        env = {**self.env, "RAY_SERVE_HAPROXY_STATS_PORT": str(self.port_base + 404 + node),
               "RAY_SERVE_HAPROXY_METRICS_PORT": str(self.port_base + 101 + node)}
        done = subprocess.run([RAY, "start", *args, *ports, "--disable-usage-stats",
                               f"--object-store-memory={self.object_store_bytes}"], env=env,
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed: {done.stderr[-2000:]}")

    def processes(self) -> list[int]:
        """This cluster's own processes (GCS, raylets, agents); Ray workers run under its raylets."""
        return self._own_processes()

    def _raylets(self) -> list[int]:
        return [pid for pid in self._own_processes() if b"raylet/raylet" in procfs.cmdline(pid)]

    def _own_processes(self) -> list[int]:
        """Processes whose command line names this cluster's temp dir (GCS, raylets, agents)."""
        return procfs.pids_matching(self.temp_dir.encode())

    def _everything_started(self) -> list[int]:
        """Those, and every process that carries this cluster's auth token in its environment: its
        workers, even orphaned and renamed (`ray::IDLE`), and drivers and load generators started
        for it (the calling process is left out)."""
        found = set(self._own_processes())
        found.update(procfs.pids_with_environment("RAY_AUTH_TOKEN", self.env["RAY_AUTH_TOKEN"]))
        return sorted(found)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
