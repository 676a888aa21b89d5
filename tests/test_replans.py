"""The bound on replans (kafila/session/control/replans.py), without a session."""

from kafila.session.control.replans import ReplanPacer


def test_a_burst_goes_at_once_then_each_replan_waits_longer_up_to_a_bound():
    p = ReplanPacer(burst=3, window_s=60.0, max_wait_s=8.0)
    waits = []
    for i in range(8):
        now = float(i)
        waits.append(p.delay(now))
        p.record(now)
    assert waits == [0.0, 0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_replans_spread_out_in_time_never_wait():
    p = ReplanPacer(burst=2, window_s=10.0)
    for i in range(10):
        now = 11.0 * i
        assert p.delay(now) == 0.0
        p.record(now)
    assert p.recent == 1
