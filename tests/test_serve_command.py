"""`shardserve serve` as a user runs it, on real local Rays: two servers on one machine never
replace each other, and a stop at any moment of start-up (or after) leaves no process and a free
port. Every wait is for an event (a process appearing, an answer); none is a wall-clock bound."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from index_build.job import build_index
from loadtests.served import Server
from shardserve.runtime import procfs
from shardserve.runtime.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.haproxy]
EXE = Path(sys.executable).parent / "shardserve"
KEY = "serve-test-key-0123456789"


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two small indexes with different versions (built without Ray)."""
    root = tmp_path_factory.mktemp("serve-command")
    built = {}
    for name, limit in (("a", 5000), ("b", 4000)):
        build_index("fashion-mnist", 2, "IVF64,Flat", str(root / name), limit=limit, backend="local")
        built[name] = root / name
    return built


def _version(index: Path) -> str:
    from shardserve.index.manifest import read_manifest
    from shardserve.index.storage import Location

    return read_manifest(Location.parse(str(index))).index_version


def serve(index: Path, port: int, env: dict | None = None) -> Server:
    return Server(index, port, flags=("--num-cpus", "2"), env=env)


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _gone(server: Server, timeout_s: float = 60) -> list[int]:
    """Processes of the server still alive once they had `timeout_s` to go (normally none at once)."""
    deadline = time.monotonic() + timeout_s
    while (left := server.pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _group_alive(pgid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid and procfs.alive(p.pid)]


def _group_gone(pgid: int, timeout_s: float = 10) -> list[int]:
    """Processes of the server's group still alive once they had `timeout_s` to exit (an orphan is
    no descendant any more, but it stays in the group)."""
    deadline = time.monotonic() + timeout_s
    while (left := _group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def test_two_servers_on_one_machine_run_side_by_side(indexes: dict[str, Path]) -> None:
    """A on P1, then B on P2: each starts its own Ray, B serves B's index, and P1 answers with A's
    index version the whole time, B's start and stop included. A third server on A's port exits in
    one line, non-zero, and A never notices."""
    a = serve(indexes["a"], free_port())
    b: Server | None = None
    watched: list[str] = []
    watching = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=10) as client:
            while not watching.is_set():
                try:
                    watched.append(client.get(f"{a.url}/v1/index").json()["index_version"])
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    watched.append(f"error: {exc!r}")
                time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    try:
        a.wait_for(a.healthy, "health on A's port")
        watcher.start()
        b = serve(indexes["b"], free_port())
        b.wait_for(b.healthy, "health on B's port")
        assert httpx.get(f"{b.url}/v1/index", timeout=10).json()["index_version"] == _version(indexes["b"])
        # two clusters, one per server: B did not join A's
        a_gcs = {pid for pid in a.pids() if b"gcs_server" in procfs.cmdline(pid)}
        b_gcs = {pid for pid in b.pids() if b"gcs_server" in procfs.cmdline(pid)}
        assert len(a_gcs) == len(b_gcs) == 1 and a_gcs != b_gcs
        clash = serve(indexes["b"], a.port)
        code, err = clash.finish()
        assert code != 0 and err.strip().splitlines()[-1] == (
            f"shardserve: error: 127.0.0.1:{a.port} is in use (Address already in use): pick another --port")
        assert not _gone(clash)
        b.signal(signal.SIGINT)
        assert b.finish()[0] == 0
        left = _gone(b)  # looked at before the clean-up below could end them
        assert not left and _port_free(b.port), [procfs.cmdline(pid)[:80] for pid in left]
        seen = len(watched)
        a.wait_for(lambda: len(watched) >= seen + 20, "20 answers from A after B stopped")
    finally:
        watching.set()
        if watcher.is_alive():
            watcher.join(timeout=30)
        if b is not None:
            b.stop()
        a.stop()
    assert watched and set(watched) == {_version(indexes["a"])}, sorted(set(watched))


# Each stage by what the command has started when the signal comes (not by time): Ray's GCS up
# (ray.init under way, nothing deployed), a Serve replica of the index up (deploy under way), the
# edge's HAProxy started (EdgeProcess.start), and the edge answering health (start-up done).
STAGES = {
    "before deploy": lambda server: server.has_process(b"gcs_server"),
    "during deploy": lambda server: server.has_process(b"ray::ServeReplica:shardserve-index"),
    "as the edge comes up": lambda server: server.has_child(b"shardserve-edge-"),
    "just after": lambda server: server.healthy(),
}


# Every CI run stops one start mid-deploy (SIGINT) and one server just up (SIGTERM, with an API key);
# the rest of the matrix runs before a release (make test-release).
RELEASE = pytest.mark.release


@pytest.mark.parametrize("stage, signum", [
    pytest.param("before deploy", signal.SIGINT, marks=RELEASE),
    ("during deploy", signal.SIGINT),
    pytest.param("as the edge comes up", signal.SIGINT, marks=RELEASE),
    pytest.param("just after", signal.SIGINT, marks=RELEASE),
    pytest.param("during deploy", signal.SIGTERM, marks=RELEASE),
    ("just after", signal.SIGTERM),
], ids=lambda value: value if isinstance(value, str) else signal.Signals(value).name)
def test_a_stop_at_any_stage_of_start_up_leaves_no_process_and_frees_the_port(
        indexes: dict[str, Path], stage: str, signum: int) -> None:
    """SIGINT or SIGTERM to the command alone, at each stage of its start: it exits without a
    traceback, and no process it started (Ray's, its workers, the edge) is left, in its process
    group or anywhere, and its port is free. Once up (with an API key), no process it started holds
    the key in its environment, and the edge wants it."""
    keyed = {"SHARDSERVE_API_KEY": KEY} if stage == "just after" else None
    server = serve(indexes["a"], free_port(), env=keyed)
    try:
        server.wait_for(lambda: STAGES[stage](server), stage)
        if stage == "just after":
            started = server.pids()
            assert started and not [pid for pid in started if pid != server.process.pid
                                    and _environ(pid).get("SHARDSERVE_API_KEY")]
            assert httpx.get(f"{server.url}/v1/index", timeout=10).status_code == 401
            assert httpx.get(f"{server.url}/v1/index", headers={"Authorization": f"Bearer {KEY}"},
                             timeout=10).status_code == 200
        server.signal(signum)
        code, err = server.finish()
        # what is left is looked at before any clean-up of the test's own
        left = _gone(server)
        described = [procfs.cmdline(pid)[:80] for pid in left]
        group = _group_gone(server.process.pid)
        described += [procfs.cmdline(pid)[:80] for pid in group]
        port_free = _port_free(server.port)
    finally:
        server.stop()
    assert "Traceback" not in err, err
    assert not left, described
    assert not group and port_free
    assert code in (0, 130, 128 + signum, signum), (code, err)


def _environ(pid: int) -> dict:
    import psutil

    try:
        return psutil.Process(pid).environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {}
