"""Unit tests of the ETTR ledger, with an explicit clock (all times = T + offset)."""

from __future__ import annotations

import random

import pytest

from stalwart.controller.report.ledger import BUCKETS, PHASES, Ledger, compute, series

T = 1_700_000_000.0  # a realistic unix start: exercises float precision
APPROX = dict(abs=1e-6)


def ev(t: float, kind: str, **data) -> dict:
    return {"t": T + t, "kind": kind, "data": data}


def steps(run: int, first: int, last: int, first_end: float, dur: float = 1.0) -> list[dict]:
    """Back-to-back steps first..last of ``run``; the first one ends at ``first_end``."""
    return [ev(first_end + (s - first) * dur, "step", run=run, step=s, dur=dur) for s in range(first, last + 1)]


def opened(t: float, incident: int, injected: float | None = None, planned: bool = False,
           symptom: str = "crash") -> dict:
    inj = None if injected is None else T + injected
    return ev(t, "incident_opened", incident=incident, symptom=symptom, injected_at=inj, planned=planned)


def crash_log(injected: float | None = None, finish: float | None = 41) -> list[dict]:
    """Run 1: steps 0..9 in [10, 20]; crash detected at 25, localized at 28; run 2
    restores step 5 and redoes 6..9 in [35, 39], then 10..11 until 41."""
    log = [ev(0, "job_submitted"), ev(10, "run_started", run=1, start_step=0)]
    log += steps(1, 0, 9, first_end=11)
    log += [opened(25, 1, injected), ev(28, "incident_localized", incident=1), ev(29, "run_stopped", run=1),
            ev(30, "run_started", run=2, start_step=6)]
    log += steps(2, 6, 11, first_end=36)
    if finish is not None:
        log.append(ev(finish, "job_finished", state="succeeded"))
    return log


def buckets(**nonzero: float) -> dict[str, float]:
    out = dict.fromkeys(BUCKETS, 0.0)
    out.update(nonzero)
    return out


def assert_buckets(led: Ledger, **nonzero: float) -> None:
    assert led.unproductive == pytest.approx(buckets(**nonzero), **APPROX)


def assert_invariant(led: Ledger) -> None:
    assert set(led.unproductive) == set(BUCKETS)
    assert all(v >= 0 for v in led.unproductive.values())
    assert sum(led.unproductive.values()) + led.productive_s == pytest.approx(led.wall_s, **APPROX)
    for phase in PHASES + ("hot_update",):
        per_incident = sum(i[phase] for i in led.incidents.values())
        assert per_incident == pytest.approx(led.unproductive[phase], **APPROX)
    assert sum(i["lost_progress"] for i in led.incidents.values()) <= led.unproductive["lost_progress"] + 1e-6
    assert 0.0 <= led.ettr <= 1.0 and 0.0 <= led.window_ettr <= 1.0


def test_no_incidents_startup_gaps_and_tail():
    log = [ev(0, "job_submitted"), ev(10, "run_started", run=1, start_step=0)]
    log += steps(1, 0, 4, first_end=21)  # [20, 25]
    log += steps(1, 5, 9, first_end=27)  # [26, 31]: a 1 s gap before step 5
    log += [ev(40, "job_finished", state="succeeded")]
    led = compute(log, now=T + 1000)
    assert led.wall_s == pytest.approx(40)
    assert led.productive_s == pytest.approx(10)
    assert led.ettr == pytest.approx(0.25)
    assert_buckets(led, startup=20, other=10)
    assert led.incidents == {}
    assert (led.steps_kept, led.steps_lost) == (10, 0)
    assert_invariant(led)


def test_crash_with_restore_redoes_steps():
    led = compute(crash_log(), now=T + 100, window_s=10)
    assert led.wall_s == pytest.approx(41)
    assert led.productive_s == pytest.approx(12)
    assert (led.steps_kept, led.steps_lost) == (12, 4)
    # lost [16, 20] outranks detection, which would start at the last kept step (16)
    assert_buckets(led, startup=10, lost_progress=4, detection=5, localization=3, failover=7)
    inc = led.incidents[1]
    assert inc["symptom"] == "crash" and inc["planned"] is False
    assert {k: inc[k] for k in ("detection", "localization", "failover", "lost_progress", "hot_update")} == \
        pytest.approx({"detection": 5, "localization": 3, "failover": 7, "lost_progress": 4, "hot_update": 0})
    assert (inc["detected_at"], inc["localized_at"], inc["resumed_at"]) == pytest.approx((25, 28, 36))
    assert inc["injected_at"] is None
    assert led.window_ettr == pytest.approx(0.6)  # [31, 41] holds 6 s of kept steps
    assert_invariant(led)


def test_injected_at_later_than_last_kept_step():
    led = compute(crash_log(injected=22), now=T + 100)
    assert led.incidents[1]["detection"] == pytest.approx(3)  # 22 -> 25
    assert led.incidents[1]["injected_at"] == pytest.approx(22)
    assert_buckets(led, startup=10, lost_progress=4, detection=3, localization=3, failover=7, other=2)
    assert_invariant(led)


def test_injected_at_earlier_than_last_kept_step_is_ignored():
    led = compute(crash_log(injected=12), now=T + 100)
    assert led.incidents[1]["detection"] == pytest.approx(5)
    assert_buckets(led, startup=10, lost_progress=4, detection=5, localization=3, failover=7)


def test_two_incidents_back_to_back():
    log = crash_log(finish=None)  # run 2 kept steps until 41
    log += [opened(44, 2, injected=42, symptom="nic"), ev(45, "incident_localized", incident=2),
            ev(45.5, "run_stopped", run=2), ev(46, "run_started", run=3, start_step=12)]
    log += steps(3, 12, 13, first_end=51)  # [50, 52]
    log += [ev(52, "job_finished", state="succeeded")]
    led = compute(log, now=T + 100)
    one, two = led.incidents[1], led.incidents[2]
    assert (one["detection"], one["localization"], one["failover"], one["lost_progress"]) == \
        pytest.approx((5, 3, 7, 4))
    assert (two["detection"], two["localization"], two["failover"], two["lost_progress"]) == \
        pytest.approx((2, 1, 5, 0))
    assert two["resumed_at"] == pytest.approx(51)
    assert_buckets(led, startup=10, lost_progress=4, detection=7, localization=4, failover=12, other=1)
    assert led.productive_s == pytest.approx(14)
    assert_invariant(led)


def test_unresolved_incident_job_failed():
    log = [e for e in crash_log(finish=None) if e["t"] < T + 30]
    log.append(ev(60, "job_finished", state="failed"))
    led = compute(log, now=T + 1000)
    inc = led.incidents[1]
    assert inc["resumed_at"] is None
    assert inc["failover"] == pytest.approx(32)  # localized 28 -> end 60
    assert_buckets(led, startup=10, detection=5, localization=3, failover=32)
    assert led.productive_s == pytest.approx(10)  # nothing was redone: all run-1 steps stay kept
    assert_invariant(led)


def test_never_localized_incident_runs_localization_to_end():
    log = [e for e in crash_log(finish=None) if e["t"] < T + 26]
    led = compute(log, now=T + 60)  # still open, job not finished: end = now
    inc = led.incidents[1]
    assert inc["localized_at"] is None and inc["resumed_at"] is None
    assert (inc["detection"], inc["localization"], inc["failover"]) == pytest.approx((5, 35, 0))
    assert_invariant(led)


def test_never_localized_but_restarted_fails_over_from_next_run():
    log = [e for e in crash_log() if e["kind"] != "incident_localized"]
    led = compute(log, now=T + 100)
    inc = led.incidents[1]
    assert (inc["localization"], inc["failover"]) == pytest.approx((5, 5))  # 25->30, 30->35
    assert_invariant(led)


def test_hot_update_goes_to_its_own_bucket():
    log = [ev(0, "job_submitted"), ev(10, "run_started", run=1, start_step=0)]
    log += steps(1, 0, 9, first_end=11)  # [10, 20]
    log += [opened(20.5, 7, planned=True, symptom="code_update"), ev(20.5, "incident_localized", incident=7),
            ev(21, "run_stopped", run=1), ev(22, "run_started", run=2, start_step=10)]
    log += steps(2, 10, 12, first_end=25)  # [24, 27]
    log += [ev(27, "job_finished", state="succeeded")]
    led = compute(log, now=T + 27)
    inc = led.incidents[7]
    assert inc["planned"] is True
    assert inc["hot_update"] == pytest.approx(4)
    assert (inc["detection"], inc["localization"], inc["failover"]) == (0.0, 0.0, 0.0)
    assert_buckets(led, startup=10, hot_update=4)
    assert led.ettr == pytest.approx(13 / 27)
    assert_invariant(led)


def test_overlapping_incidents_charge_overlap_to_earlier_one():
    """Incident 2 opens at 31, during incident 1's failover (28 -> 32)."""
    log = crash_log(finish=None)[:-6]  # drop run 2's steps
    log += steps(2, 6, 6, first_end=33)  # [32, 33]: incident 1 resumes
    log += [opened(31, 2, symptom="fail_slow"), ev(34, "incident_localized", incident=2),
            ev(34.5, "run_stopped", run=2), ev(35, "run_started", run=3, start_step=7)]
    log += steps(3, 7, 9, first_end=38)  # [37, 40]
    log += [ev(40, "job_finished", state="succeeded")]
    log.sort(key=lambda e: e["t"])
    led = compute(log, now=T + 40)
    one, two = led.incidents[1], led.incidents[2]
    assert (one["detection"], one["localization"], one["failover"]) == pytest.approx((5, 3, 4))
    # 2's detection (16 -> 31) lies under lost progress and incident 1; of its localization
    # (31 -> 34) only 33 -> 34 is left after incident 1 (31-32) and the kept step (32-33).
    assert (two["detection"], two["localization"], two["failover"]) == pytest.approx((0, 1, 3))
    assert one["lost_progress"] == pytest.approx(4) and two["lost_progress"] == 0
    assert led.productive_s == pytest.approx(10)
    assert_buckets(led, startup=10, lost_progress=4, detection=5, localization=4, failover=7)
    assert_invariant(led)


def test_incident_entirely_inside_another_gets_nothing():
    log = crash_log(finish=None)[:-6]
    log += [opened(33, 2, symptom="crash"), ev(34, "incident_localized", incident=2),
            ev(35, "run_started", run=3, start_step=6)]
    log += steps(3, 6, 7, first_end=41)  # [40, 42]
    led = compute(log, now=T + 42)
    assert led.incidents[1]["failover"] == pytest.approx(12)  # 28 -> 40
    two = led.incidents[2]
    assert (two["detection"], two["localization"], two["failover"]) == (0.0, 0.0, 0.0)
    assert two["resumed_at"] == pytest.approx(41)
    assert_invariant(led)


def test_crash_before_first_step_detection_starts_at_run_start():
    log = [ev(0, "job_submitted"), ev(10, "run_started", run=1, start_step=0), opened(15, 1),
           ev(16, "incident_localized", incident=1), ev(18, "run_started", run=2, start_step=0)]
    log += steps(2, 0, 0, first_end=21)
    led = compute(log, now=T + 21)
    assert_buckets(led, startup=10, detection=5, localization=1, failover=4)
    assert_invariant(led)


def test_running_job_uses_now_and_ignores_later_events():
    led = compute(crash_log(), now=T + 38)
    assert led.wall_s == pytest.approx(38)
    # as of 38, run 2 has redone steps 6..8 (the one ending exactly at 38 counts); run 1's
    # step 9 is not redone yet, so it is still kept
    assert led.productive_s == pytest.approx(7 + 3)
    assert (led.steps_kept, led.steps_lost) == (10, 3)
    assert_invariant(led)


def test_job_that_never_stepped_is_all_startup():
    led = compute([ev(0, "job_submitted"), ev(5, "run_started", run=1, start_step=0)], now=T + 50)
    assert led.ettr == 0.0 and led.window_ettr == 0.0
    assert_buckets(led, startup=50)


def test_zero_wall_is_zero_ettr():
    led = compute([ev(0, "job_submitted")], now=T)
    assert (led.wall_s, led.ettr, led.window_ettr) == (0.0, 0.0, 0.0)


def test_duplicate_step_in_same_run_keeps_the_last():
    log = [ev(0, "job_submitted"), ev(0, "run_started", run=1, start_step=0)]
    log += [ev(1, "step", run=1, step=0, dur=1.0), ev(2, "step", run=1, step=0, dur=1.0)]
    led = compute(log, now=T + 2)
    assert (led.steps_kept, led.steps_lost) == (1, 1)
    assert_buckets(led, lost_progress=1)


def test_to_dict_is_plain_data():
    d = compute(crash_log(), now=T + 100).to_dict()
    assert d["unproductive"]["failover"] == pytest.approx(7)
    assert d["incidents"][1]["resumed_at"] == pytest.approx(36)
    assert set(d) == {"wall_s", "productive_s", "ettr", "unproductive", "incidents", "window_ettr",
                      "steps_kept", "steps_lost"}


def test_series_points_match_compute():
    log = crash_log()
    pts = series(log, now=T + 100, points=4, window_s=10)
    assert len(pts) == 4
    assert [p["elapsed_s"] for p in pts] == pytest.approx([10.25, 20.5, 30.75, 41])
    assert pts[-1]["t"] == pytest.approx(T + 41)
    led = compute(log, now=T + 100, window_s=10)
    assert pts[-1]["ettr"] == pytest.approx(led.ettr)
    assert pts[-1]["window_ettr"] == pytest.approx(led.window_ettr)
    assert pts[-1]["unproductive"] == pytest.approx(led.unproductive)
    # at 20.5: kept [10, 16] = 6 s; window [10.5, 20.5] holds 5.5 s of it
    assert pts[1]["ettr"] == pytest.approx(6 / 20.5)
    assert pts[1]["window_ettr"] == pytest.approx(5.5 / 10)
    assert pts[1]["unproductive"]["lost_progress"] == pytest.approx(4)
    assert pts[0]["unproductive"]["startup"] == pytest.approx(10)
    for p in pts:
        assert sum(p["unproductive"].values()) + p["productive_s"] == pytest.approx(p["elapsed_s"], **APPROX)


@pytest.mark.parametrize("bad, message", [
    ([ev(0, "run_started", run=1, start_step=0)], "no job_submitted"),
    ([ev(5, "job_submitted"), ev(1, "run_started", run=1)], "sorted"),
    ([ev(0, "job_submitted"), ev(1, "incident_localized", incident=3)], "unknown incident 3"),
    ([ev(0, "job_submitted"), ev(1, "step", run=1, step=0, dur=-1.0)], "dur >= 0"),
    ([ev(0, "job_submitted"), ev(1, "step", run="a", step=0, dur=1.0)], "integer"),
    ([ev(0, "job_submitted"), opened(1, 1), opened(2, 1)], "opened twice"),
    ([{"t": "x", "kind": "job_submitted", "data": {}}], "finite number"),
    ([{"t": T, "kind": "job_submitted", "data": []}], "data must be a dict"),
])
def test_bad_input_raises_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        compute(bad, now=T + 10)


def test_bad_arguments_raise():
    log = crash_log()
    with pytest.raises(ValueError, match="before job_submitted"):
        compute(log, now=T - 1)
    with pytest.raises(ValueError, match="window_s"):
        compute(log, now=T + 100, window_s=0)
    with pytest.raises(ValueError, match="points"):
        series(log, now=T + 100, points=0)


def random_log(rng: random.Random) -> tuple[list[dict], float, dict]:
    """A random but plausible job: runs, redone steps, incidents (some overlapping,
    planned, never localized), finished or still running.  Returns (log, now, truth)
    where truth holds the durations of kept/lost executions computed independently."""
    t = rng.uniform(0, 5)
    log = [ev(t, "job_submitted")]
    execs: list[tuple[int, int, float]] = []  # (run, step, dur) in execution order
    next_step, incident = 0, 0
    for run in range(1, rng.randint(1, 6) + 1):
        t += rng.choice([0.0, rng.uniform(0, 20)])
        log.append(ev(t, "run_started", run=run, start_step=next_step))
        for _ in range(rng.randint(0, 12)):
            dur = rng.choice([1.0, rng.uniform(0.1, 3)])
            t += rng.choice([0.0, 0.0, rng.uniform(0, 2)]) + dur
            log.append(ev(t, "step", run=run, step=next_step, dur=dur))
            execs.append((run, next_step, dur))
            next_step += 1
        if rng.random() < 0.8:
            last_end = t
            t += rng.uniform(0, 10)
            inj = rng.choice([None, last_end - rng.uniform(0, 5), rng.uniform(last_end, t)])
            incident += 1
            log.append(opened(t, incident, injected=inj, planned=rng.random() < 0.2))
            if rng.random() < 0.3:  # a second incident overlapping the first
                t += rng.uniform(0, 3)
                incident += 1
                log.append(opened(t, incident, planned=rng.random() < 0.2))
            for i in range(incident, 0, -1):
                if rng.random() < 0.7:
                    t += rng.uniform(0, 5)
                    log.append(ev(t, "incident_localized", incident=i))
        t += rng.uniform(0, 3)
        log.append(ev(t, "run_stopped", run=run))
        next_step = rng.randint(max(0, next_step - 5), next_step)  # restore point
    now = t + rng.uniform(0, 10)
    if rng.random() < 0.5:
        log.append(ev(now, "job_finished", state=rng.choice(["succeeded", "failed"])))
        now += rng.uniform(0, 100)
    last_run_of: dict[int, int] = {}
    for i, (_, step, _) in enumerate(execs):
        last_run_of[step] = i
    kept = [execs[i][2] for i in last_run_of.values()]
    lost = [d for i, (_, _, d) in enumerate(execs) if last_run_of[execs[i][1]] != i]
    return log, T + now, {"kept": kept, "lost": lost}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(300))
def test_random_logs_buckets_add_up(seed):
    rng = random.Random(seed)
    log, now, truth = random_log(rng)
    led = compute(log, now=now, window_s=rng.choice([5.0, 30.0, 3600.0]))
    assert_invariant(led)
    assert (led.steps_kept, led.steps_lost) == (len(truth["kept"]), len(truth["lost"]))
    assert led.productive_s == pytest.approx(sum(truth["kept"]), abs=1e-5)
    assert led.unproductive["lost_progress"] == pytest.approx(sum(truth["lost"]), abs=1e-5)
    for inc in led.incidents.values():
        assert all(inc[k] >= 0 for k in ("detection", "localization", "failover", "lost_progress", "hot_update"))
        if inc["resumed_at"] is not None:
            assert inc["resumed_at"] >= inc["detected_at"]
    pts = series(log, now=now, points=7)
    assert pts[-1]["ettr"] == pytest.approx(led.ettr)
    assert all(0.0 <= p["ettr"] <= 1.0 and 0.0 <= p["window_ettr"] <= 1.0 for p in pts)


@pytest.mark.timeout(30)
def test_long_log_is_fast():
    """90 daily runs of 10 s steps (78k steps, 90 incidents): bounded by the timeout."""
    log = [ev(0, "job_submitted")]
    t, step = 0.0, 0
    for run in range(1, 91):
        t += 60
        log.append(ev(t, "run_started", run=run, start_step=step))
        for _ in range(8640 // 10):
            t += 10
            log.append(ev(t, "step", run=run, step=step, dur=10.0))
            step += 1
        t += 30
        log.append(opened(t, run))
        log.append(ev(t + 5, "incident_localized", incident=run))
        t += 10
        step -= 3
    led = compute(log, now=T + t + 100)
    assert led.steps_lost == 3 * 89  # the last run's steps are never redone
    assert_invariant(led)


def test_injection_time_learned_at_localization_counts_for_detection():
    ev = [{"t": 0.0, "kind": "job_submitted", "data": {}},
          {"t": 0.0, "kind": "run_started", "data": {"run": 1, "start_step": 0}},
          {"t": 1.0, "kind": "step", "data": {"run": 1, "step": 0, "dur": 1.0}},
          {"t": 5.0, "kind": "incident_opened", "data": {"incident": 1, "symptom": "x", "injected_at": None}},
          {"t": 6.0, "kind": "incident_localized", "data": {"incident": 1, "injected_at": 4.0}},
          {"t": 6.0, "kind": "run_started", "data": {"run": 2, "start_step": 1}},
          {"t": 8.0, "kind": "step", "data": {"run": 2, "step": 1, "dur": 1.0}},
          {"t": 8.0, "kind": "job_finished", "data": {"state": "succeeded"}}]
    from stalwart.controller.report.ledger import compute
    led = compute(ev, 8.0)
    assert led.incidents[1]["injected_at"] == 4.0
    assert led.incidents[1]["detection"] == 1.0      # from the injection, not from the last step


# -- the controller's absence ----------------------------------------------------------

def test_a_controller_gap_is_its_own_bucket_and_steps_meanwhile_stay_productive():
    """Steps 0..9 in [10, 20]; the controller is silent from 12 and reconciled at 17; steps went on."""
    log = [ev(0, "job_submitted"), ev(10, "run_started", run=1, start_step=0)]
    log += steps(1, 0, 9, first_end=11)
    log += [ev(15, "control_plane_down", down_at=T + 12, up_at=T + 15),
            ev(17, "control_plane_reconciled", down_at=T + 12), ev(20, "job_finished", state="succeeded")]
    log.sort(key=lambda e: e["t"])
    led = compute(log, now=T + 20)
    assert_invariant(led)
    assert led.productive_s == pytest.approx(10.0, **APPROX)       # the run kept training
    assert_buckets(led, startup=10.0)                               # nothing left for control_plane


def test_a_gap_with_no_training_is_booked_as_control_plane():
    log = [ev(0, "job_submitted"), ev(10, "run_started", run=1, start_step=0)]
    log += steps(1, 0, 4, first_end=11)                            # last step ends at 15
    log += [ev(25, "control_plane_down", down_at=T + 16, up_at=T + 25),
            ev(26, "control_plane_reconciled", down_at=T + 16)]
    log += steps(1, 5, 6, first_end=28)                            # [27, 29]
    log.append(ev(29, "job_finished", state="succeeded"))
    led = compute(log, now=T + 29)
    assert_invariant(led)
    assert led.unproductive["control_plane"] == pytest.approx(10.0, **APPROX)   # [16, 26]
    assert_buckets(led, startup=10.0, control_plane=10.0, other=2.0)
