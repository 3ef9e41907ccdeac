"""A Jaeger all-in-one on loopback (`make jaeger` builds it into .bin/jaeger; configs/jaeger/ pins
it): OTLP over HTTP in, spans in memory, the query API out. What the traced tests read spans back
from, and what a user runs to look at shardserve's traces (`python -m loadtests.jaeger`).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from loadtests.served import wait_for
from shardserve.runtime.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
BINARY = ROOT / ".bin" / "jaeger"
CONFIG = ROOT / "configs" / "jaeger" / "config.yaml"


class Jaeger:
    """One Jaeger process, on free loopback ports unless given. `otlp`: the traces URL spans are
    exported to; `query`: the query API's base URL (and the UI's)."""

    def __init__(self, otlp_port: int | None = None, query_port: int | None = None):
        if not BINARY.exists():
            raise FileNotFoundError(f"{BINARY} is missing: run `make jaeger`")
        self.otlp_port, self.query_port = otlp_port or free_port(), query_port or free_port()
        self.otlp = f"http://127.0.0.1:{self.otlp_port}/v1/traces"
        self.query = f"http://127.0.0.1:{self.query_port}"
        handle, name = tempfile.mkstemp(prefix="shardserve-jaeger-", suffix=".log")
        os.close(handle)
        self.log = Path(name)
        env = {**os.environ, "JAEGER_OTLP_PORT": str(self.otlp_port),
               "JAEGER_QUERY_PORT": str(self.query_port), "JAEGER_QUERY_GRPC_PORT": str(free_port())}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen([str(BINARY), "--config", str(CONFIG)], stdout=out,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float = 60.0) -> Jaeger:
        def answering() -> bool:
            try:
                return httpx.get(f"{self.query}/api/services", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(answering, f"Jaeger's query API at {self.query} ({self.output()[-2000:]})", timeout_s,
                 interval_s=0.2, process=self.process)
        return self

    def trace(self, trace_id: str) -> dict | None:
        """The trace as Jaeger's query API has it now ({"spans": [...], "processes": {...}}), or None."""
        answer = httpx.get(f"{self.query}/api/traces/{trace_id}", timeout=10)
        if answer.status_code == 404:
            return None
        answer.raise_for_status()
        data = answer.json().get("data") or []
        return data[0] if data else None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: a trace store gone at once, as a crash leaves it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="run Jaeger on loopback for shardserve's traces")
    parser.add_argument("--otlp-port", type=int, default=4318)
    parser.add_argument("--query-port", type=int, default=16686)
    args = parser.parse_args()
    jaeger = Jaeger(args.otlp_port, args.query_port).wait_ready()
    print(f"jaeger: spans to {jaeger.otlp} (shardserve serve --trace-endpoint {jaeger.otlp}); "
          f"UI and query API at {jaeger.query}; Ctrl-C stops it", flush=True)
    try:
        while jaeger.process.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        jaeger.stop()


if __name__ == "__main__":
    main()
