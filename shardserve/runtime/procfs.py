"""This machine's processes, through psutil (pid-reuse safe, no /proc parsing of our own): what stops
a Ray (or HAProxy) we started and only that, and what each part of a serving stack costs.

Two things psutil does not give are read here by hand, and tested: per-thread nice values
(`lower_priority`) and run-queue wait from schedstat (`sched_times`)."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import psutil

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def cmdline(pid: int) -> bytes:
    """NUL-separated command line (b"" when the process is gone or not ours to read)."""
    try:
        return "\0".join(psutil.Process(pid).cmdline()).encode(errors="surrogateescape")
    except _GONE:
        return b""


def parent(pid: int) -> int:
    try:
        return psutil.Process(pid).ppid()
    except _GONE:
        return 0


def lower_priority(nice: int) -> int:
    """Raise this process's nice value to at least `nice`, every thread of it (on Linux a nice
    value is per thread; threads started later inherit it). Returns the nice value now in effect.

    Why a serving process does this once it is up: on a saturated node, a replica that is starting
    (a new Ray worker: seconds of CPU for Python, Ray, Serve and FAISS imports and the index)
    otherwise gets only the share of each busy one.
    Lowering one's own priority needs no privilege; raising it back does."""
    for tid in [thread.id for thread in psutil.Process().threads()]:
        with contextlib.suppress(OSError):  # a thread that just ended
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
    return os.getpriority(os.PRIO_PROCESS, 0)


@contextlib.contextmanager
def idle_while() -> Iterator[None]:
    """The calling thread at Linux's idle scheduling class (SCHED_IDLE) inside the block: it runs
    only on CPU no other thread of the node wants, and any of them preempts it at once. Entering
    needs no privilege; leaving (back to SCHED_OTHER) needs CAP_SYS_NICE or an RLIMIT_NICE that
    allows the thread's nice value, and without them the thread stays idle-class. Used around code
    that holds no lock others wait for (a model run that releases the GIL): a thread preempted
    while holding the GIL would stall every other thread of its process."""
    policy = getattr(os, "SCHED_IDLE", None)
    try:
        if policy is not None:
            os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: this thread, on Linux
    except OSError:
        policy = None
    try:
        yield
    finally:
        if policy is not None:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent's wait() is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except _GONE:
        return False


def pids_matching(fragment: bytes) -> list[int]:
    """Processes whose command line contains `fragment`."""
    return [p.pid for p in psutil.process_iter() if fragment in cmdline(p.pid)]


def pids_with_environment(name: str, value: str) -> list[int]:
    """Processes (other than this one) started with `name=value` in their environment: what a
    process inherited, which renaming itself (Ray workers become `ray::IDLE`) or losing its parent
    does not change."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        with contextlib.suppress(*_GONE):
            if process.environ().get(name) == value:
                found.append(process.pid)
    return found


def descendants(root: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    except _GONE:
        return []


def stop(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM, wait up to grace_s for every pid to exit, then SIGKILL the rest and wait again."""
    processes = []
    for pid in pids:
        with contextlib.suppress(*_GONE):
            processes.append(psutil.Process(pid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            with contextlib.suppress(*_GONE):
                process.send_signal(sig)
        _, processes = psutil.wait_procs(processes, timeout=grace_s)
        if not processes:
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


def terminate(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End a child we started: SIGTERM, wait up to `grace_s`, then SIGKILL; reaped either way."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the process (all its threads) so far; 0 when it is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except _GONE:
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
        return max(time.time() - psutil.Process(pid).create_time(), 0.0)
    except _GONE:
        return 0.0


def memory_mb(pid: int) -> dict[str, float]:
    """Resident memory of a process, split as the kernel does: `rss_anon_mb` is its own (heap,
    copies), `rss_file_mb` file pages it maps (a memory-mapped index: page cache, shared by every
    process mapping the same file). Empty when the process is gone."""
    try:
        info = psutil.Process(pid).memory_info()
    except _GONE:
        return {}
    shared = getattr(info, "shared", 0)  # file-backed resident pages (RssFile + RssShmem)
    return {"rss_mb": round(info.rss / 2**20, 1), "rss_file_mb": round(shared / 2**20, 1),
            "rss_anon_mb": round((info.rss - shared) / 2**20, 1)}


def cpu_model() -> str:
    """This machine's CPU model name, for records."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


SERVE_COMMAND = "shardserve serve (its command)"  # it started the node's Ray and watches the edge


def _is_serve_command(argv: list[bytes]) -> bool:
    """`shardserve serve …` or `python -m serving.cli serve …`."""
    for at, word in enumerate(argv[:3]):
        if word.endswith(b"/shardserve") or word == b"shardserve" or word == b"serving.cli":
            return argv[at + 1:at + 2] == [b"serve"]
    return False


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
    if _is_serve_command(command.split(b"\0")[:4]):
        return SERVE_COMMAND
    if command.startswith((b"ray::", b"ray-dashboard-")) or b"/ray/" in command or b"raylet" in command \
            or b"gcs_server" in command:
        return "Ray system"
    return None


def machine_cpu_seconds() -> dict[str, float]:
    """CPU seconds of every core of this machine so far: `busy` (user, nice, system, irq, softirq,
    steal) and `idle` (idle, iowait)."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + t.irq + t.softirq + t.steal
    return {"busy": busy, "idle": t.idle + t.iowait}


SELF_CLASS = "measuring process"


def classified_pids(classify: Callable[[bytes], str | None] = process_class) -> dict[int, str]:
    """Every process but this one that `classify` names a part of the stack, by its command line."""
    found = {}
    for process in psutil.process_iter():
        if process.pid != os.getpid():
            name = classify(cmdline(process.pid))
            if name is not None:
                found[process.pid] = name
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
