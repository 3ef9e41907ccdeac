"""Prometheus beside `shardserve serve --prometheus-port PORT`: Debian's `prometheus`, run with the
scrape configuration Ray's dashboard writes for its session (`<session>/metrics/prometheus/
prometheus.yml`: every node's metrics agent, as Ray's service discovery file lists them), so the
series users tune capacity with (`shardserve_*`, `ray_serve_*`) are queryable and graphed in
Prometheus's own UI, and the Ray dashboard finds it (RAY_PROMETHEUS_HOST, set before Ray starts).

It listens on loopback only (Prometheus has no authentication of its own, and its query API reads
every series): reach it from another machine through an SSH tunnel, as the dashboard. Its admin
and lifecycle APIs stay off (Prometheus's default). Its data lives in the session directory and
goes with it; retention is a day.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from shardserve.errors import ShardserveError
from shardserve.runtime import procfs

RAY_CONFIG = Path("metrics") / "prometheus" / "prometheus.yml"  # under the session directory
HOST = "127.0.0.1"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusProcess:
    """One Prometheus this process starts and stops (by its own pid), on HOST:`port`, scraping what
    the Ray session at `session` lists."""

    def __init__(self, session: Path, port: int):
        self.session, self.port = session, port
        self.url = f"http://{HOST}:{port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> PrometheusProcess:
        """Start it once Ray's dashboard has written the session's configuration, and return when
        it answers ready. Whatever ends start() early leaves nothing running."""
        binary = prometheus_binary()
        if binary is None:
            raise ShardserveError("prometheus not found (Debian package `prometheus`; `make prometheus`)")
        config = self.session / RAY_CONFIG
        try:
            self._wait(config.exists, f"Ray's Prometheus configuration {config}", timeout_s)
            log = (self.session / "logs" / "prometheus.log").open("ab")
            with log:  # the child keeps its own descriptor
                self.process = subprocess.Popen(
                    [binary, f"--config.file={config}", f"--web.listen-address={HOST}:{self.port}",
                     f"--storage.tsdb.path={self.session / 'prometheus'}",
                     "--storage.tsdb.retention.time=1d"],
                    stdout=log, stderr=subprocess.STDOUT)
            self._wait(self.ready, f"Prometheus ready at {self.url} (its log: {log.name})", timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise ShardserveError(f"prometheus on {HOST}:{self.port} exited ({self.process.returncode}): "
                                  f"see {self.session / 'logs' / 'prometheus.log'}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @staticmethod
    def _wait(done, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise ShardserveError(f"no {what} after {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            procfs.terminate(self.process)
            self.process = None
