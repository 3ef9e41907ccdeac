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
import socket
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
                 port: int = 26380, port_base: int = 27000, detect_death_s: float = 3.0,
                 store: RedisStore | None = None, worker_wait_for_head_s: float | None = None,
                 head_resources: dict[str, float] | None = None, own_temp_dirs: bool = False,
                 node_env: dict[str, str] | None = None, node_ips: bool = False):
        """`store`: Ray's GCS keeps its state in this Redis (GCS fault tolerance).
        `own_temp_dirs`: every node its own temp dir, so the head's processes can be told apart,
        killed and started again (`kill_head`, `restart_head`; with a store or without, the
        control). `worker_wait_for_head_s`: how long worker raylets wait for a lost GCS
        (RAY_gcs_rpc_server_reconnect_timeout_s). `node_env`: set on every node and driver (what
        its replicas inherit, e.g. RedisStore.write_log_env()). `node_ips`: every worker node its own
        loopback address (`node_ip`), as nodes of a real cluster have, so that what binds its
        node's address (a router's door with front_host="node", an edge) is that node's alone."""
        self.workers = workers
        self.store, self.own_temp_dirs = store, own_temp_dirs or store is not None
        self.worker_wait_for_head_s = worker_wait_for_head_s
        self.head_resources = {"shardserve_head": 1} if head_resources is None else head_resources
        self.worker_cpus = worker_cpus
        self.head_cpus = head_cpus
        self.port = port
        self.port_base = port_base  # per-node agent/metrics ports: no clash with another local Ray
        self.temp_dir = tempfile.mkdtemp(prefix="rmn", dir="/tmp")  # short: unix socket paths
        self.worker_raylets: list[int] = []
        self.object_store_bytes = 512 * 1024 * 1024  # per node; the default (30% of RAM) x 3 nodes
        period_ms = 500
        self.node_env = dict(node_env or {})
        self.node_ips = node_ips
        self.env = {
            **os.environ, **SERVING_NODE_ENV, **self.node_env,
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
        keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", *SERVING_NODE_ENV, *self.node_env)
        return {k: self.env[k] for k in keys}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def node_ip(self, node: int) -> str:
        """Worker `node`'s address (1, 2, ...): 127.0.0.(node + 1) with `node_ips`."""
        if not self.node_ips or node < 1:
            raise ValueError("node_ip needs node_ips=True and a worker number (1, 2, ...)")
        return f"127.0.0.{node + 1}"

    def node_temp_dir(self, node: int) -> str:
        """Node `node`'s temp dir (0: the head): one per node with `own_temp_dirs`, else the cluster's."""
        return f"{self.temp_dir}/n{node}" if self.own_temp_dirs else self.temp_dir

    def __enter__(self) -> LocalCluster:
        try:
            self._start_head()
            for number, resources in enumerate(self.workers, start=1):
                before = set(self._raylets())
                extra = [f"--temp-dir={self.node_temp_dir(number)}"] if self.own_temp_dirs else []
                if self.node_ips:
                    extra.append(f"--node-ip-address={self.node_ip(number)}")
                self._ray_start(f"--address={self.address}", f"--num-cpus={self.worker_cpus}",
                                "--resources", json.dumps(resources), *extra, node=number)
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

    def _start_head(self) -> None:
        store = [] if self.store is None else [f"--redis-password={self.store.password}"]
        self._ray_start("--head", f"--port={self.port}", f"--num-cpus={self.head_cpus}",
                        f"--temp-dir={self.node_temp_dir(0)}", "--include-dashboard=false",
                        f"--ray-client-server-port={self.port_base + 1}",
                        "--resources", json.dumps(self.head_resources), *store, node=0)

    def kill_head(self) -> list[int]:
        """Head failure: SIGKILL every process of the head node at once (GCS, raylet, its agents,
        the workers under it: Serve's controller); the pids killed."""
        if not self.own_temp_dirs:
            raise RuntimeError("kill_head needs own_temp_dirs: the head's processes are found by theirs")
        head = procfs.pids_matching(f"{self.node_temp_dir(0)}/".encode())
        victims = sorted({*head, *(d for pid in head for d in procfs.descendants(pid))})
        for pid in victims:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(procfs.alive(p) for p in victims):
            time.sleep(0.1)
        return victims

    def restart_head(self) -> None:
        """The same `ray start --head` again (its temp dir's ray_current_cluster removed first:
        `ray start` refuses while it names a GCS address a surviving worker still uses)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{self.node_temp_dir(0)}/ray_current_cluster")
        self._start_head()

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
        if self.store is not None and node == 0:
            env.update(self.store.head_env())
        if self.worker_wait_for_head_s is not None and node > 0:
            env["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(int(self.worker_wait_for_head_s))
        done = subprocess.run([RAY, "start", *args, *ports, "--disable-usage-stats",
                               f"--object-store-memory={self.object_store_bytes}"], env=env,
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            shown = " ".join("--redis-password=…" if a.startswith("--redis-password=") else a for a in args)
            raise RuntimeError(f"ray start {shown} failed: {done.stderr[-2000:]}")

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


class RedisStore:
    """Debian's redis-server on loopback for Ray's GCS fault tolerance: its own password (in a
    config file only its owner reads, not on its command line), `appendonly yes` with `appendfsync
    always`, its files in a temp dir; stopped by its pid. `with RedisStore() as store:`."""

    def __init__(self, port: int = 26479, binary: str = "/usr/bin/redis-server"):
        self.port, self.binary = port, binary
        self.password = secrets.token_hex(24)
        # fresh per run: a restarted head takes back whatever its namespace holds
        self.namespace = f"shardserve-{secrets.token_hex(6)}"
        self.dir = tempfile.mkdtemp(prefix="redis-", dir="/tmp")
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def head_env(self) -> dict[str, str]:
        return {"RAY_REDIS_ADDRESS": self.address, "RAY_external_storage_namespace": self.namespace}

    def __enter__(self) -> RedisStore:
        if not os.access(self.binary, os.X_OK):
            raise SystemExit(f"{self.binary} not found: run `make redis` (Debian's redis-server)")
        config = Path(self.dir) / "redis.conf"
        config.touch(mode=0o600)
        config.write_text(f"bind 127.0.0.1\nport {self.port}\nrequirepass {self.password}\n"
                          f"dir {self.dir}\nappendonly yes\nappendfsync always\nsave \"\"\n"
                          "daemonize no\nprotected-mode yes\n")
        (Path(self.dir) / "password").touch(mode=0o600)
        (Path(self.dir) / "password").write_text(self.password)
        try:
            self.start()
            return self
        except BaseException:
            self.__exit__(None, None, None)  # stopped, its files (the password's too) removed
            raise

    def start(self) -> None:
        """Start redis-server on its config (again, after `kill`: it reloads its append-only file)."""
        self.process = subprocess.Popen([self.binary, str(Path(self.dir) / "redis.conf")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._answers_ping():
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            time.sleep(0.2)
        raise RuntimeError("redis-server did not answer within 20 s")

    def kill(self) -> None:
        """SIGKILL redis-server (its files stay: `start` again)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def write_log_env(self) -> dict[str, str]:
        """The environment that puts every index's write log in this Redis
        (shardserve.writes.redis_log): its URL and the file holding its password."""
        return {"SHARDSERVE_WRITE_LOG": f"redis://{self.address}/0",
                "SHARDSERVE_WRITE_LOG_PASSWORD_FILE": str(Path(self.dir) / "password")}

    def _answers_ping(self) -> bool:
        """AUTH then PING over the wire (RESP inline commands): True once it answers +PONG."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                conn.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                answer = b""
                while b"+PONG" not in answer and b"-" not in answer and len(answer) < 256:
                    chunk = conn.recv(64)
                    if not chunk:
                        break
                    answer += chunk
                return b"+PONG" in answer
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            procfs.terminate(self.process)
        shutil.rmtree(self.dir, ignore_errors=True)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
