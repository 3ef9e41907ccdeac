"""The warm worker pool (core.warm_pool): its refill rule, its /proc census, and on real Ray that a
prestarted worker is what the next actor runs in (the reason a scaled-up shard replica starts in
about a second: loadtests/records/autoscale.json)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from core.procfs import age_seconds
from core.warm_pool import STARTING, idle_jiffies, pooled_workers, workers_to_start


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
        deadline = time.monotonic() + 10
        while pooled_workers(os.getpid()) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # until bash has exec'd
        assert pooled_workers(os.getpid()) == before + 2
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert pooled_workers(os.getpid()) == before


def test_idle_cpu_is_read_from_the_node() -> None:
    idle, total = idle_jiffies()
    assert 0 < idle <= total


@pytest.mark.usefixtures("ray_cluster")
def test_next_actor_runs_in_a_prestarted_worker() -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Keeper:
        def prestart(self, count: int) -> int:
            from core.ray_private import prestart_workers

            before = pooled_workers(os.getppid())  # a Ray worker's parent is its raylet
            prestart_workers(count, keep_alive_s=120)
            deadline = time.monotonic() + 60
            while pooled_workers(os.getppid()) < before + count and time.monotonic() < deadline:
                time.sleep(0.1)
            return pooled_workers(os.getppid()) - before

    @ray.remote(num_cpus=0)
    class Probe:
        def age(self) -> float:
            return age_seconds(os.getpid())

    keeper = Keeper.remote()
    assert ray.get(keeper.prestart.remote(2), timeout=120) >= 2
    time.sleep(3)  # the prestarted workers finish starting (their imports) and wait, idle
    asked = time.monotonic()
    probe = Probe.remote()
    age = ray.get(probe.age.remote(), timeout=60)
    # The probe's process is older than the request that created it: it was waiting in the pool.
    assert age > time.monotonic() - asked + 1.0
    for actor in (keeper, probe):
        ray.kill(actor)
