"""This machine's processes from /proc: what stops a Ray (or HAProxy) we started, and only that."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable


def cmdline(pid: int) -> bytes:
    """NUL-separated command line ("" when the process is gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def lower_priority(nice: int) -> int:
    """Raise this process's nice value to at least `nice`, every thread of it (on Linux a nice
    value is per thread; threads started later inherit it). Returns the nice value now in effect.

    Why a serving process does this once it is up: on a saturated node, a replica that is starting
    (a new Ray worker: about 2 s of CPU for Python, Ray, Serve and FAISS imports and the index)
    otherwise gets only the share of each busy one (loadtests/records/autoscale.json).
    Lowering one's own priority needs no privilege; raising it back does."""
    tasks = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tasks:
        with contextlib.suppress(OSError):  # a thread that just ended
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
    return os.getpriority(os.PRIO_PROCESS, 0)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent's wait() is not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_matching(fragment: bytes) -> list[int]:
    """Processes whose command line contains `fragment`."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and fragment in cmdline(int(e))]


def pids_with_environment(name: str, value: str) -> list[int]:
    """Processes (other than this one) started with `name=value` in their environment: what a
    process inherited, which renaming itself (Ray workers become `ray::IDLE`) or losing its parent
    does not change."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if wanted in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            children.setdefault(parent(int(entry)), []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def stop(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM, wait up to grace_s for every pid to exit, then SIGKILL the rest and wait again."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.05)
        if not any(alive(p) for p in pids):
            return


def interrupt(process: subprocess.Popen, timeout_s: float = 120.0) -> int:
    """Ctrl-C a command we started in its own session (`start_new_session=True`): SIGINT its process
    group, wait for a clean exit, SIGKILL the group after `timeout_s`. Returns its exit code."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the process (all its threads) so far; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return 0.0


def sched_times(pid: int) -> tuple[float, float, int, int]:
    """(seconds on a CPU, seconds runnable but waiting in a run queue, voluntary and involuntary
    context switches) of the process, summed over its threads (/proc/<pid>/task/*/schedstat and
    status); zeros when it is gone. Waiting while a core is idle means the scheduler, not the
    work, holds a request up."""
    run = wait = voluntary = involuntary = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0, 0, 0
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                on_cpu, queued, _ = handle.read().split()
            with open(f"/proc/{pid}/task/{tid}/status") as handle:
                status = dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)
        except (OSError, ValueError):
            continue  # the thread ended between the listing and the read
        run += int(on_cpu)
        wait += int(queued)
        voluntary += int(status.get("voluntary_ctxt_switches", 0))
        involuntary += int(status.get("nonvoluntary_ctxt_switches", 0))
    return run / 1e9, wait / 1e9, voluntary, involuntary


def age_seconds(pid: int) -> float:
    """Seconds since the process started (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            started = int(handle.read().rsplit(")", 1)[1].split()[19]) / _CLOCK_TICKS
        with open("/proc/uptime") as handle:
            return float(handle.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return 0.0


def memory_mb(pid: int) -> dict[str, float]:
    """Resident memory of a process, split as the kernel does: `rss_anon_mb` is its own (heap,
    copies), `rss_file_mb` file pages it maps (a memory-mapped index: page cache, shared by every
    process mapping the same file). Empty when the process is gone."""
    wanted = {"RssAnon": "rss_anon_mb", "RssFile": "rss_file_mb", "VmRSS": "rss_mb"}
    found: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in wanted:
                    found[wanted[key]] = round(int(rest.split()[0]) / 1024, 1)  # kB
    except (OSError, ValueError, IndexError):
        return {}
    return found


def process_class(command: bytes) -> str | None:
    """Which part of a serving stack a process is, from its command line (None: not ours)."""
    if b"vegeta" in command.split(b"\0", 1)[0]:
        return "load generator"
    if b"haproxy" in command:
        return "ingress (HAProxy)"
    if command.startswith(b"ray::ServeReplica:"):
        deployment = command.split(b"\0", 1)[0].rsplit(b":", 1)[-1]
        if deployment.startswith(b"shard-"):
            return "shards"
        if deployment == b"Router":
            return "router"
        return "other Serve replicas"
    if command.startswith(b"ray::") or b"/ray/" in command or b"raylet" in command \
            or b"gcs_server" in command:
        return "Ray system"
    return None


def machine_cpu_seconds() -> dict[str, float]:
    """CPU seconds of every core of this machine so far, from /proc/stat: `busy` (user, nice,
    system, irq, softirq, steal) and `idle` (idle, iowait)."""
    with open("/proc/stat") as handle:
        ticks = [int(v) for v in handle.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    return {"busy": (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS,
            "idle": (idle + iowait) / _CLOCK_TICKS}


SELF_CLASS = "measuring process"


def classified_pids(classify: Callable[[bytes], str | None] = process_class) -> dict[int, str]:
    """Every process but this one that `classify` names a part of the stack, by its command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            name = classify(cmdline(int(entry)))
            if name is not None:
                found[int(entry)] = name
    return found


class CpuMeter:
    """CPU seconds per process class over a window, read from /proc at its start and end.

    `extra` names process trees by their root pid (e.g. a baseline server and its workers).
    Processes that start inside the window count from zero; ones that exit inside it are lost
    (their CPU is not in /proc any more), so measure steady-state windows. With `include_self`
    the measuring process is its own class (SELF_CLASS: in a bench it is also a Ray driver, which a
    cluster deployed with `shardserve deploy` does not keep). `machine` holds the whole machine's busy and
    idle seconds over the same window: what no class explains, and what no process used.
    """

    def __init__(self, extra: dict[str, int] | None = None,
                 classify: Callable[[bytes], str | None] | None = None, include_self: bool = False):
        self.extra = extra or {}
        self.classify = classify or process_class
        self.include_self = include_self
        self._start: dict[int, tuple[str, float]] = {}
        self._machine_start: dict[str, float] = {}
        self.machine: dict[str, float] = {}

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        classes: dict[int, str] = {}
        for name, root in self.extra.items():
            for pid in [root, *descendants(root)]:
                classes[pid] = name
        for pid, found in classified_pids(self.classify).items():
            classes.setdefault(pid, found)
        if self.include_self:
            classes.setdefault(os.getpid(), SELF_CLASS)
        return {pid: (name, cpu_seconds(pid)) for pid, name in classes.items()}

    def start(self) -> None:
        self._start = self._snapshot()
        self._machine_start = machine_cpu_seconds()

    def stop(self) -> dict[str, float]:
        """CPU seconds used per class since start()."""
        machine_end = machine_cpu_seconds()
        used: dict[str, float] = {}
        for pid, (name, cpu) in self._snapshot().items():
            before = self._start.get(pid, (name, 0.0))[1]
            used[name] = used.get(name, 0.0) + max(cpu - before, 0.0)
        self.machine = {key: machine_end[key] - self._machine_start[key] for key in machine_end}
        return used
