# ruff: noqa: E501  (perf script lines are long, kept verbatim)
"""The per-CPU replay of scheduler events (lab.sched_trace), on hand-written perf lines."""

from lab.sched_trace import parse_perf_script, replay

LINES = """\
  python  10 [000]  1.000000:       sched:sched_switch: prev_comm=swapper/0 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=router next_pid=10 next_prio=139
  swapper  0 [001]  1.000000:       sched:sched_switch: prev_comm=a prev_pid=30 prev_prio=120 prev_state=S ==> next_comm=swapper/1 next_pid=0 next_prio=120
  router  10 [000]  1.001000:       sched:sched_waking: comm=shard pid=20 prio=139 target_cpu=000
  router  10 [000]  1.003000:       sched:sched_migrate_task: comm=shard pid=20 prio=139 orig_cpu=0 dest_cpu=1
  swapper  0 [001]  1.004000:       sched:sched_switch: prev_comm=swapper/1 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=shard next_pid=20 next_prio=139
     :-1  -1 [000]  1.006000:       sched:sched_switch: prev_comm=router prev_pid=10 prev_prio=139 prev_state=X ==> next_comm=swapper/0 next_pid=0 next_prio=120
  shard   20 [001]  1.010000:       sched:sched_switch: prev_comm=shard prev_pid=20 prev_prio=139 prev_state=S ==> next_comm=swapper/1 next_pid=0 next_prio=120
""".splitlines()


def test_idle_is_split_into_stranded_work_and_nothing_runnable():
    events = parse_perf_script(LINES + ["not an event line"])
    assert [e.name for e in events].count("sched_switch") == 5  # the exiting task's tid -1 line too
    timeline = replay(events, cpus=2, class_of={20: "shards", 10: "router"})
    assert abs(timeline.wall_s - 0.010) < 1e-9
    # CPU 1 idled 1.000-1.004 (shard 20 queued on CPU 0 for 1.001-1.003, then on CPU 1 itself)
    # and 1.010 onwards is past the last event; CPU 0 idled 1.006-1.010 with nothing queued.
    assert abs(timeline.idle_s[1] - 0.004) < 1e-9
    assert abs(timeline.idle_with_work_elsewhere_s[1] - 0.002) < 1e-9
    assert abs(timeline.stranded_by_class_s["shards"] - 0.002) < 1e-9
    assert abs(timeline.idle_s[0] - 0.004) < 1e-9
    assert timeline.idle_with_work_elsewhere_s[0] == 0
    summary = timeline.summary()
    assert summary["idle_percent_of_cores"] == 40.0
    assert summary["idle_with_work_queued_elsewhere_percent_of_cores"] == 10.0
