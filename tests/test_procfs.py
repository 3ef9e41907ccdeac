"""/proc helpers on this very process: priority, memory, age (no Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from loadtests.served import wait_for
from loadtests.vegeta_run import machine_share
from shardserve.runtime.procfs import (
    SELF_CLASS,
    SERVE_COMMAND,
    CpuMeter,
    age_seconds,
    machine_cpu_seconds,
    memory_mb,
    pids_with_environment,
    process_class,
    sched_times,
)


def test_lower_priority_reaches_every_thread_and_never_raises_it() -> None:
    """In a child process (a nice value cannot be raised back): threads started before and after."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base > 16:
        pytest.skip(f"this process already runs at nice {base}")
    target = base + 2
    script = textwrap.dedent(f"""
        import contextlib, os, threading
        from shardserve.runtime.procfs import lower_priority
        gate = threading.Event()
        before = threading.Thread(target=gate.wait, daemon=True); before.start()
        try:
            assert lower_priority({target}) == {target}
            seen = {{}}
            def record():
                seen["n"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            after = threading.Thread(target=record); after.start(); after.join()
            nice = set()
            for tid in os.listdir("/proc/self/task"):
                with contextlib.suppress(ProcessLookupError):  # a thread still exiting
                    nice.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
            print(sorted(nice), seen["n"], lower_priority({base}))
        finally:
            gate.set()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # every thread at the target, the later thread too; asking for less keeps the target
    assert out.stdout.split() == [f"[{target}]", str(target), str(target)], out


def test_memory_and_age_of_this_process() -> None:
    memory = memory_mb(os.getpid())
    assert memory["rss_mb"] > 0 and memory["rss_anon_mb"] > 0 and memory["rss_file_mb"] > 0
    import psutil

    assert 0 < age_seconds(os.getpid()) <= time.time() - psutil.boot_time()  # started after boot
    assert memory_mb(2**22 + 12345) == {} and age_seconds(2**22 + 12345) == 0.0  # no such process



def _burn(seconds: float) -> None:
    deadline = time.process_time() + seconds
    while time.process_time() < deadline:
        pass


def test_the_meter_sees_its_own_process_and_the_machine_only_when_asked() -> None:
    """A bench's own process is a Ray driver: counted as its own class, apart from the servers."""
    meter = CpuMeter(include_self=True)
    meter.start()
    _burn(0.3)
    used = meter.stop()
    assert used[SELF_CLASS] >= 0.25
    assert meter.machine["busy"] >= 0.25 and meter.machine["idle"] >= 0
    quiet = CpuMeter()
    quiet.start()
    _burn(0.05)
    assert SELF_CLASS not in quiet.stop()


def test_machine_counters_only_grow() -> None:
    before = machine_cpu_seconds()
    _burn(0.05)
    after = machine_cpu_seconds()
    assert after["busy"] > before["busy"] and after["idle"] >= before["idle"]


def test_machine_share_splits_busy_idle_and_unaccounted() -> None:
    share = machine_share({"busy": 12.0, "idle": 4.0}, accounted_s=10.0)
    assert share == {"busy_percent": 75.0, "idle_percent": 25.0, "busy_unaccounted_percent": 12.5}
    assert machine_share({"busy": 0.0, "idle": 0.0}, 0.0) == {}


def test_sched_times_count_this_process_running() -> None:
    run, wait, voluntary, involuntary = sched_times(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # 50 ms on a CPU
        pass
    time.sleep(0.01)  # one voluntary switch at least
    run_after, wait_after, voluntary_after, involuntary_after = sched_times(os.getpid())
    assert run_after - run >= 0.04 and wait_after >= wait >= 0.0
    assert voluntary_after > voluntary and involuntary_after >= involuntary
    assert sched_times(2**22 + 12345) == (0.0, 0.0, 0, 0)  # no such process


def test_pids_with_environment_finds_a_child_by_what_it_inherited_never_this_process() -> None:
    token = f"t{os.getpid()}-{time.monotonic_ns()}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env={**os.environ, "SHARDSERVE_TEST_TOKEN": token})
    try:
        os.environ["SHARDSERVE_TEST_TOKEN"] = token  # this process is left out whatever its environment
        wait_for(lambda: pids_with_environment("SHARDSERVE_TEST_TOKEN", token) == [child.pid],
                 "the child, alone, found by its environment", timeout_s=10)
        assert pids_with_environment("SHARDSERVE_TEST_TOKEN", token + "x") == []
    finally:
        os.environ.pop("SHARDSERVE_TEST_TOKEN", None)
        child.kill()
        child.wait()


def test_the_serve_command_is_a_class_of_its_own_and_other_commands_are_not() -> None:
    served = process_class(b"/venv/bin/python3\0/venv/bin/shardserve\0serve\0indexes/x")
    assert served == SERVE_COMMAND
    assert process_class(b"python3\0-m\0serving.cli\0serve\0indexes/x") == SERVE_COMMAND
    assert process_class(b"/venv/bin/python3\0/venv/bin/shardserve\0build\0--out\0x") is None
    assert process_class(b"python3\0-m\0serving.cli\0swap\0indexes/x") is None
    assert process_class(b"python3\0serve.py\0serve") is None


def test_the_dashboards_module_processes_are_rays() -> None:
    # what /proc/PID/cmdline holds for the dashboard's modules: setproctitle's title, then the
    # interpreter's own arguments, NUL-separated (no "/ray/" in any of them)
    title = b"ray-dashboard-NodeHead-0\0(/venv/bin/python3\0-B\0-c\0from multiprocessing.forkserver import"
    assert process_class(title) == "Ray system"
