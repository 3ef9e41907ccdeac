"""The warm worker pool (runtime.warm_pool): its refill rule, its /proc census, and on real Ray that a
prestarted worker is what the next actor runs in (the reason a scaled-up shard replica starts in
about a second: loadtests/records/autoscale.json)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from loadtests.served import wait_for
from shardserve.runtime.procfs import age_seconds, cmdline
from shardserve.runtime.warm_pool import (
    IDLE_TITLE,
    STARTING,
    idle_jiffies,
    pooled_pids,
    pooled_workers,
    workers_to_start,
)


def test_refill_waits_for_its_time_and_spare_cpu_and_adds_one_at_a_time() -> None:
    def decide(pooled=1, not_before=5.0, now=10.0, idle=1.5):
        return workers_to_start(pooled, 4, now, not_before, idle_cores=idle, min_idle_cores=0.5)

    assert decide() == 1  # short, its time has come, idle node: one worker, not the whole shortfall
    assert decide(pooled=4) == 0 and decide(pooled=6) == 0  # full (or over)
    assert decide(not_before=None) == 0  # not short
    assert decide(not_before=12.0) == 0  # just taken, or just topped up: not yet
    assert decide(idle=0.2) == 0  # a busy node: the burst's replicas need the CPU


def test_census_counts_idle_and_starting_children_only(tmp_path) -> None:
    """This process stands in for the raylet: its children are counted. (Under the whole suite it
    may also be the parent of a real raylet, whose command line names default_worker.py further
    on: it must not count.)"""
    script = tmp_path / STARTING.decode()  # a worker still starting: python …/default_worker.py
    script.write_text("import time; time.sleep(60)")
    before = pooled_workers(os.getpid())
    children = [
        subprocess.Popen(["bash", "-c", "exec -a ray::IDLE sleep 60"]),  # an idle Ray worker's title
        subprocess.Popen([sys.executable, str(script), "--flag"]),
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",  # anything else,
                          f"--python_worker_command={sys.executable} {script}"]),  # even naming it
    ]
    try:
        wait_for(lambda: pooled_workers(os.getpid()) >= before + 2, "both pooled children counted",
                 timeout_s=10)
        assert pooled_workers(os.getpid()) == before + 2  # two, not more (once bash has exec'd)
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert pooled_workers(os.getpid()) == before


def test_idle_cpu_is_read_from_the_node() -> None:
    idle, total = idle_jiffies()
    assert 0 < idle <= total


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_next_actor_runs_in_a_prestarted_worker() -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Keeper:
        def prestart(self) -> int:
            """New pooled processes after asking the raylet for one: counted by pid, not as a net
            pool size (the raylet reaps other idle workers above its soft limit meanwhile), and
            asked again if the raylet declined (it starts no more than its startup concurrency at
            once: best effort, which is why the keeper re-checks every second)."""
            from shardserve.runtime.ray_private import prestart_workers

            raylet = os.getppid()  # a Ray worker's parent is its raylet
            before = set(pooled_pids(raylet))
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                prestart_workers(1, keep_alive_s=120)
                asked = time.monotonic()
                while time.monotonic() < min(deadline, asked + 15):
                    new = set(pooled_pids(raylet)) - before
                    if any(cmdline(pid).startswith(IDLE_TITLE) for pid in new):  # started, waiting
                        return len(new)
                    time.sleep(0.1)
            return 0

    @ray.remote(num_cpus=0)
    class Probe:
        def age(self) -> float:
            return age_seconds(os.getpid())

    keeper = Keeper.remote()
    assert ray.get(keeper.prestart.remote(), timeout=120) >= 1
    asked = time.monotonic()
    probe = Probe.remote()
    age = ray.get(probe.age.remote(), timeout=60)
    # The probe's process is older than the request that created it: it was waiting in the pool
    # (a process spawned for the probe would be younger than that; /proc ages tick in 10 ms).
    assert age > time.monotonic() - asked + 0.05
    for actor in (keeper, probe):
        ray.kill(actor)


def test_wait_filled_waits_for_the_pool_and_gives_up_at_its_timeout() -> None:
    """`shardserve serve` says it is serving once the pool is full; a node that cannot fill it
    within the timeout does not hold the command forever. Time is moved, not slept."""
    import itertools

    from shardserve.runtime import warm_pool

    now = itertools.count()  # each clock read one second later
    moved = {"clock": lambda: next(now), "sleep": lambda s: None}
    assert not warm_pool.wait_filled(os.getpid(), 1, timeout_s=5, **moved)  # this process has no pool
    assert warm_pool.wait_filled(os.getpid(), 0, timeout_s=5, **moved)
