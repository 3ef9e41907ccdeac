"""A warm pool of idle Ray workers on each serving node, so a new shard replica skips the imports.

A scale-up's new replica is otherwise a new Ray worker process: spawn, `import ray`, Ray Serve (with
pandas), FAISS and this package, then the index — seconds of CPU, on a node whose cores the burst
already saturates.
Ray's raylet can start idle workers ahead of need and keep them alive (`shardserve.runtime.ray_private.
prestart_workers`), and with `RAY_preload_python_modules` in the environment Ray starts with
(`runtime.ray_session.SERVING_NODE_ENV`) those workers have already imported the serving code. An actor
placed on the node — a Serve replica with no runtime_env of its own — takes an idle worker when
there is one, so what is left of its start is Serve's replica set-up and the index (mapped).

One keeper per node: every shard replica runs `WarmPool`, and the one holding an flock on a file
named by the node's raylet pid tops the pool up (the others retry the lock; the kernel frees it
when its holder dies). Idle workers are the raylet's children titled "ray::IDLE"; workers still
starting count too, so a top-up is not repeated while the last one is under way.

Filling the pool costs CPU (a preloaded worker does those imports at Ray's worker priority, above
the serving replicas'), so the keeper fills from spare cycles only: one worker at a time, once the
pool has been short for `refill_after_s`, and only while the node has `min_idle_cores` idle. During
a burst, when the replicas being started need the CPU, it waits (several workers prestarted at
once make even a light load's latency jump). A steady load that leaves less than a core idle waits
too: a worker's imports run at Ray's worker priority, above the serving replicas' nice 19, so a
top-up beside a steady open loop can stall the shards long enough for the edge to shed. `shardserve serve`
waits for the pool before it says it is serving (`wait_filled`), so its first minutes fill nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
import time

import psutil

from shardserve.runtime import procfs

logger = logging.getLogger("ray.serve")
IDLE_TITLE = b"ray::IDLE"
STARTING = b"default_worker.py"  # a worker's command line before it retitles itself
KEEP_ALIVE_S = 3600  # the raylet does not reap a prestarted idle worker before this
SETTLE_S = 2.0  # between two top-ups: longer than the CPU a preloaded worker's start takes
QUIET_CPU_S = 0.02  # an idle worker that used less CPU than this over a wait_filled period has started


def workers_to_start(pooled: int, target: int, now: float, not_before: float | None,
                     idle_cores: float, min_idle_cores: float) -> int:
    """How many workers to prestart now (0 or 1): one while the pool is below `target`, once
    `not_before` has passed (set `refill_after_s` after the pool fell short, `SETTLE_S` after the
    last top-up) and the node has `min_idle_cores` to spare. Pure: unit-tested."""
    if pooled >= target or not_before is None or now < not_before:
        return 0
    return int(idle_cores >= min_idle_cores)


def idle_jiffies() -> tuple[float, float]:
    """(idle + iowait, total) CPU seconds of the node so far (psutil)."""
    t = psutil.cpu_times()
    idle = t.idle + t.iowait
    return idle, idle + t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def pooled_pids(raylet_pid: int) -> list[int]:
    """The raylet's idle workers plus those still starting (its children)."""
    return [child for child in _children(raylet_pid) if _pooled(procfs.cmdline(child))]


def _pooled(line: bytes) -> bool:
    """Idle ("ray::IDLE") or still starting (`python [setup_worker.py] …/default_worker.py --flags`:
    the script is one of the first arguments; the raylet's own command line names it too, inside
    a flag further on)."""
    args = line.split(b"\0")
    return args[0].startswith(IDLE_TITLE) or any(arg.endswith(STARTING) for arg in args[1:3])


def pooled_workers(raylet_pid: int) -> int:
    return len(pooled_pids(raylet_pid))


def _children(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


class WarmPool:
    """Keeps `target` idle workers on this node while this process holds the node's keeper lock
    (a daemon thread; started from a Ray worker, whose parent is the raylet)."""

    def __init__(self, target: int, period_s: float = 1.0, refill_after_s: float = 5.0,
                 min_idle_cores: float = 1.0):
        self.target, self.period_s, self.refill_after_s = target, period_s, refill_after_s
        self.min_idle_cores = min_idle_cores
        self.cores = os.cpu_count() or 1
        self.raylet_pid = os.getppid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="warm-pool", daemon=True)

    def start(self) -> WarmPool:
        if self.target > 0 and b"raylet" in procfs.cmdline(self.raylet_pid):
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        lock_path = os.path.join(tempfile.gettempdir(), f"shardserve-warm-pool-{self.raylet_pid}.lock")
        with open(lock_path, "a") as lock:
            while not self._stop.is_set():  # wait to be this node's keeper
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    self._stop.wait(5 * self.period_s)
            not_before: float | None = None
            idle_before, total_before = idle_jiffies()
            while not self._stop.wait(self.period_s):
                pooled, now = pooled_workers(self.raylet_pid), time.monotonic()
                idle, total = idle_jiffies()
                idle_cores = self.cores * (idle - idle_before) / max(total - total_before, 1.0)
                idle_before, total_before = idle, total
                if pooled >= self.target:
                    not_before = None
                elif not_before is None:  # just fell short: the replica that took one starts first
                    not_before = now + self.refill_after_s
                count = workers_to_start(pooled, self.target, now, not_before, idle_cores,
                                         self.min_idle_cores)
                if count:
                    self._prestart(count)
                    not_before = now + SETTLE_S  # one at a time: each one's imports take CPU

    def _prestart(self, count: int) -> None:
        from shardserve.runtime.ray_private import prestart_workers

        try:
            prestart_workers(count, KEEP_ALIVE_S)
        except Exception as exc:  # best effort: a replica serves whether or not the pool fills
            logger.warning("warm pool: prestarting %d workers failed: %s", count, exc)
            self._stop.wait(30 * self.period_s)


def raylet_of(driver_pid: int) -> int | None:
    """The raylet a driver started (`ray.init` of a local Ray starts it as the driver's child)."""
    for child in _children(driver_pid):
        if b"raylet" in procfs.cmdline(child).split(b"\0", 1)[0]:
            return child
    return None


def wait_filled(raylet_pid: int, target: int, timeout_s: float, period_s: float = 0.5,
                clock=time.monotonic, sleep=time.sleep) -> bool:
    """Wait until the node's pool holds `target` idle workers that have finished starting: titled
    ray::IDLE and quiet (under QUIET_CPU_S of CPU over the last `period_s`: a worker is titled before
    its preloaded imports end). False when it did not within `timeout_s` (a busy node fills later)."""
    deadline = clock() + timeout_s
    before: dict[int, float] = {}
    while True:
        now = {pid: procfs.cpu_seconds(pid) for pid in pooled_pids(raylet_pid)
               if procfs.cmdline(pid).startswith(IDLE_TITLE)}
        quiet = [pid for pid, cpu in now.items() if pid in before and cpu - before[pid] < QUIET_CPU_S]
        if len(quiet) >= target:
            return True
        if clock() >= deadline:
            return False
        before = now
        sleep(period_s)
