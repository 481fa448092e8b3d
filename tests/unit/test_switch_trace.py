"""The request-anatomy tests' finder of untraced switches (tests/support/switch_trace.py)."""

import switch_trace

TRACE = """\
# tracer: nop
          python-20713   [001] d..2. 11429.639978: sched_switch: prev_comm=python prev_pid=20713 prev_prio=120 prev_state=R ==> next_comm=python next_pid=20714 next_prio=120
          python-20714   [001] d..2. 11429.641376: sched_switch: prev_comm=python prev_pid=20714 prev_prio=120 prev_state=R ==> next_comm=python next_pid=20710 next_prio=120
          python-20486   [000] d..2. 11429.641186: sched_switch: prev_comm=python prev_pid=20486 prev_prio=120 prev_state=R ==> next_comm=rcu_preempt next_pid=15 next_prio=120
     rcu_preempt-15      [000] d..2. 11429.641195: sched_switch: prev_comm=rcu_preempt prev_pid=15 prev_prio=120 prev_state=I ==> next_comm=python next_pid=20486 next_prio=120
          python-20710   [001] d..2. 11429.642506: sched_switch: prev_comm=python prev_pid=20710 prev_prio=120 prev_state=R ==> next_comm=agent-worker next_pid=93 next_prio=110
          python-20713   [001] d..2. 11429.644169: sched_switch: prev_comm=python prev_pid=20713 prev_prio=120 prev_state=R ==> next_comm=python next_pid=20710 next_prio=120
"""


def test_a_break_in_a_cpus_chain_of_switches_is_where_a_switch_went_untraced():
    # CPU 1 started task 93, then stopped 20713: 93's switch away was not traced
    assert switch_trace.breaks(TRACE) == [(11429_642506000, 11429_644169000)]


def test_an_unbroken_chain_has_no_breaks_and_overlaps_are_of_open_intervals():
    assert switch_trace.breaks("\n".join(TRACE.splitlines()[:5])) == []
    windows = [(100, 200)]
    assert switch_trace.overlaps(windows, 150, 300) and switch_trace.overlaps(windows, 0, 101)
    assert not switch_trace.overlaps(windows, 200, 300) and not switch_trace.overlaps(windows, 0, 100)
