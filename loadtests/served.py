"""`shardserve serve` as a user runs it, started and stopped for load tests and the test suite.

`Server` is the one place either starts the command: in its own session (Ctrl-C reaches it alone),
its output in a log file, and every process it starts (Ray's, its workers, the edge) marked with a
run id in its environment, which renaming itself or losing its parent does not change, so a test
can kill all of them, or check that none is left. `wait_for` is the one way either waits for
something to happen: a condition polled until it holds, never a sleep of a guessed length.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from shardserve.runtime import procfs

RUN_ENV = "SHARDSERVE_SERVED_RUN"  # every process a server starts inherits it: how kills find them
T = TypeVar("T")


def wait_for(condition: Callable[[], T], what: str, timeout_s: float = 60.0, interval_s: float = 0.05,
             process: subprocess.Popen | None = None) -> T:
    """Call `condition` until it returns something true, and return that. AssertionError naming
    `what` once `timeout_s` has passed, or as soon as `process` (if given) has exited."""
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        if process is not None and process.poll() is not None:
            raise AssertionError(f"exited ({process.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(interval_s)
    return found


class Server:
    """One `shardserve serve INDEX --port PORT FLAGS...`, its output appended to `log` (a temporary
    file when None)."""

    def __init__(self, index: Path | str, port: int, log: Path | None = None, flags: tuple[str, ...] = (),
                 env: dict[str, str] | None = None):
        self.run, self.port, self.index = uuid.uuid4().hex, port, index
        if log is None:
            handle, name = tempfile.mkstemp(prefix="shardserve-serve-", suffix=".log")
            os.close(handle)
            log = Path(name)
        self.log = log
        self._log = log.open("a")
        self._start = self._log.tell()
        exe = Path(sys.executable).parent / "shardserve"
        environment = {**os.environ, **(env or {}), "RAY_ADDRESS": "", RUN_ENV: self.run}
        self.process = subprocess.Popen([str(exe), "serve", str(index), "--port", str(port), *flags],
                                        env=environment, stdin=subprocess.DEVNULL,
                                        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        """Live processes carrying this server's run id (the command itself included)."""
        return [pid for pid in procfs.pids_with_environment(RUN_ENV, self.run) if procfs.alive(pid)]

    def replica(self, deployment: bytes) -> int | None:
        """The pid of a Serve replica of `deployment` (b"Router", b"shard-000") of this server."""
        for pid in self.pids():
            command = procfs.cmdline(pid).split(b"\0", 1)[0]
            if command.startswith(b"ray::ServeReplica:") and command.rsplit(b":", 1)[-1] == deployment:
                return pid
        return None

    def has_process(self, fragment: bytes) -> bool:
        """Any process of this server whose command line holds `fragment`."""
        return any(fragment in procfs.cmdline(pid) for pid in self.pids())

    def has_child(self, fragment: bytes) -> bool:
        """A direct child of the command whose command line holds `fragment` (a quick look: a child
        may live for half a second)."""
        import psutil

        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return False
        return any(fragment in procfs.cmdline(child.pid) for child in children)

    def output(self) -> str:
        """What this start of the server has printed so far (stdout and stderr, in order)."""
        if not self._log.closed:
            self._log.flush()
        with self.log.open(errors="replace") as text:
            text.seek(self._start)
            return text.read()

    def said(self, text: str) -> int:
        """How many lines of the log so far (every start of a server writing it) hold `text`."""
        if not self._log.closed:
            self._log.flush()
        return sum(text in line for line in self.log.read_text(errors="replace").splitlines())

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_for(self, condition: Callable[[], T], what: str, timeout_s: float = 600,
                 interval_s: float = 0.05) -> T:
        """`wait_for` that fails at once if the command exits first; either failure shows what the
        server printed."""
        try:
            return wait_for(condition, what, timeout_s, interval_s, process=self.process)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: serve said:\n{self.output()[-4000:]}") from None

    def wait_said(self, text: str, more_than: int, timeout_s: float = 600) -> None:
        self.wait_for(lambda: self.said(text) > more_than, f"the server saying {text!r}", timeout_s)

    def wait_healthy(self, timeout_s: float = 600) -> None:
        self.wait_for(self.healthy, f"health at {self.url}", timeout_s)

    def signal(self, signum: int) -> None:
        """To the command's own pid only: Ray's processes and the edge get nothing from a terminal;
        the command must stop them itself."""
        os.kill(self.process.pid, signum)

    def finish(self, timeout_s: float = 120) -> tuple[int, str]:
        """Wait for the command to exit: its exit code and everything it printed."""
        code = self.process.wait(timeout=timeout_s)
        return code, self.output()

    def kill_all(self) -> int:
        """SIGKILL every process of the server at once (the command, Ray, the edge); wait until gone."""
        killed: set[int] = set()
        deadline = time.monotonic() + 60
        # again until none is left: a process may be starting one (Ray's agents) as it is killed
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(left)
            time.sleep(0.2)
        self.process.wait(timeout=60)
        return len(killed)

    def stop(self) -> None:
        """Ctrl-C, then anything of the server still running is ended (a test's clean-up)."""
        if self.process.poll() is None:
            procfs.interrupt(self.process, timeout_s=60)
        procfs.stop(self.pids(), grace_s=5)
        self._log.close()
