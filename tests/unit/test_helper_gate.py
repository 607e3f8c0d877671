"""The helper gate's rule for "something else holds the helper's core" (the rest of the
gate, with a real helper thread and a real spinning process, is in
tests/integration/test_cpu_kernels.py)."""
from appliance.engines.cpu_kernels.helper_gate import BUSY_SHARE, BUSY_WAIT_NS, core_taken

MS = 1_000_000


def test_a_daemon_waking_during_a_step_does_not_take_the_core():
    # served at 8 clients the helper of a lent ~11 ms step waited 8-29% of it: the
    # daemon streaming that step's tokens on the same core, not a core taken
    assert not core_taken(int(0.29 * 11 * MS), 11 * MS)
    assert not core_taken(int(2.5 * MS), 50 * MS)      # over 2 ms, but 5% of the step


def test_a_process_sharing_the_core_takes_it():
    # a spinner on the core gets half of it under a fair scheduler
    assert core_taken(25 * MS, 50 * MS)
    assert core_taken(int(BUSY_SHARE * 50 * MS) + 1, 50 * MS)
    assert not core_taken(int(BUSY_SHARE * 50 * MS) - 1, 50 * MS)


def test_short_steps_need_more_than_the_floor():
    # 40% of a 4 ms step is 1.6 ms: a wake-up's jitter, under the floor
    assert not core_taken(int(0.4 * 4 * MS), 4 * MS)
    assert core_taken(BUSY_WAIT_NS + 1, 4 * MS)
