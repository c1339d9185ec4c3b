from stalwart.controller.cluster.beats import BeatLateness


def test_lateness_is_the_largest_gap_beyond_the_interval_and_is_forgotten_after_two_windows():
    b = BeatLateness(heartbeat_s=0.5, window_s=10.0)
    b.heard(None, 0.0)                      # registration: no gap yet
    assert b.late_s(0.0) == 0.0
    b.heard(0.0, 0.5)                       # on time
    b.heard(0.5, 0.9)                       # early (events count as beats)
    assert b.late_s(1.0) == 0.0
    b.heard(0.9, 2.1)                       # 0.7 s late
    b.heard(2.1, 2.7)                       # 0.1 s late: the max stays
    assert abs(b.late_s(3.0) - 0.7) < 1e-9
    assert abs(b.late_s(12.0) - 0.7) < 1e-9   # the previous window still counts
    b.heard(11.5, 12.1)
    assert abs(b.late_s(21.0) - 0.1) < 1e-9   # the 0.7 s is two windows old: forgotten
    assert b.late_s(60.0) == 0.0              # nothing heard for long: nothing remembered
