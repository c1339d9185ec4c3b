"""HangWatch (explicit clock), the non-SDK activity test and the NaN / jump anomaly rules."""

import dataclasses
import math
import random

import pytest
from plainhang import PlainHangWatch

from stalwart.analyzer.activity import ActivitySample, progressed
from stalwart.controller.rules.anomalies import anomaly, culprit_machines, nan_culprits
from stalwart.controller.rules.hangwatch import HangWatch
from stalwart.spec import Policy
from stalwart.topology import Topology


def saved(w):
    """Every field of a hang watch, its marks per rank (`_state`, `_recent`) built from the arrays."""
    return {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}


def run_steps(hw, ranks, steps, step_s, t0=0.0, skip=None):
    """Every rank reports steps 0..steps-1, one every ``step_s`` seconds; ``skip(rank, step)``
    True leaves that report (and the rank's later ones) out.  Returns the last time."""
    t = t0
    stopped = set()
    for s in range(steps):
        t = t0 + (s + 1) * step_s
        for r in ranks:
            if r in stopped or (skip and skip(r, s)):
                stopped.add(r)
                continue
            hw.on_step(r, s, t + 0.001 * r)
    return t


def first_detection(hw, start, end, every=0.5):
    """Poll check() like the controller's loop; return the first verdict and its time."""
    n = int((end - start) / every) + 1
    for i in range(n):
        now = start + i * every
        v = hw.check(now)
        if v is not None:
            return v
    return None


def test_fast_job_hang_fires_within_timeout_plus_one_second():
    """0.1 s steps, 4 ranks; rank 2 stops reporting at step 50, the others finish 50 and block."""
    hw = HangWatch(Policy(), ranks=range(4), started_at=0.0)
    last = run_steps(hw, range(4), 51, 0.1, skip=lambda r, s: r == 2 and s == 50)
    assert hw.calibrated and hw.timeout() == pytest.approx(10.0)  # floor beats 5 x 0.1 s
    rank2_last = last - 0.1 + 0.002
    assert hw.check(rank2_last + 9.9) is None
    v = first_detection(hw, last, last + 30)
    assert v is not None
    assert hw.timeout() < v.detected_at - rank2_last <= hw.timeout() + 1.0
    assert v.stalled == {2: pytest.approx(rank2_last)}     # the others reported 0.1 s later
    assert v.laggards == [2] and v.waiting_step == 51 and v.last_step[2] == 49
    assert 2 in v.stalled and v.calibrated
    assert "ranks [2] never reported step 50" in v.reason


def test_all_ranks_silent_same_step_has_no_laggards_and_verdict_is_latched():
    hw = HangWatch(Policy(), ranks=range(2), started_at=0.0)
    last = run_steps(hw, range(2), 20, 0.1)
    v = first_detection(hw, last, last + 20)
    assert v.laggards == [] and sorted(v.stalled) == [0, 1]
    assert "all ranks stopped after step 19" in v.reason
    assert hw.check(last + 100) is v          # same verdict, same detected_at
    hw.on_step(0, 20, last + 101)             # progress resets the latch ...
    assert hw.check(last + 101.5) is None     # ... and the 101 s interval raised the timeout
    assert hw.timeout() == pytest.approx(5 * 101, abs=0.01)
    v2 = hw.check(last + 101 + 506)
    assert v2 is not v and v2.detected_at == last + 607 and sorted(v2.stalled) == [0, 1]


def test_ten_minute_steps_no_false_positive_then_a_real_hang():
    """Steps of 600 s (first one 900 s with compilation), agent activity every 5 s."""
    hw = HangWatch(Policy(), ranks=range(2), started_at=0.0)
    t = 0.0
    step_end = [900.0 + 600.0 * i for i in range(8)]
    polls = 0
    for i, end in enumerate(step_end):
        while t < end:
            t += 5.0
            for r in range(2):
                hw.on_activity(r, t)    # the worker computes: CPU time grows
            assert hw.check(t) is None, (i, t, hw.timeout())
            polls += 1
        for r in range(2):
            hw.on_step(r, i, end)
    assert hw.calibrated and hw.timeout() == pytest.approx(3000.0)
    # Now a hang: no step reports any more; the process still spins (activity) — after
    # calibration only steps count.
    last = step_end[-1]
    for k in range(1, 700):
        now = last + 5.0 * k
        for r in range(2):
            hw.on_activity(r, now)
        v = hw.check(now)
        if v:
            break
    assert v is not None and 3000 < v.detected_at - last <= 3000 + 5  # polled every 5 s


def test_a_rank_counts_from_its_workers_start_and_an_unstarted_one_has_its_agents_bound():
    """A loaded machine's agent waits for its fork server to import torch before it starts the
    workers: their warm-up clock starts then, not at the run's start; a worker never reported
    started (nor seen doing anything) is the agent's for `worker_start_s` more."""
    pol = Policy(hang_timeout_floor_s=1.0, worker_start_s=30.0)
    hw = HangWatch(pol, ranks=range(2), started_at=0.0)
    assert hw.check(11.0) is None                   # 10 s warm-up, nobody started: the agents' time
    hw.on_started([0], 12.0)                        # machine 0's worker; machine 1's still starting
    assert hw.check(21.0) is None                   # rank 0 may be waiting for rank 1
    hw.on_started([1], 15.0)
    assert hw.check(24.9) is None                   # both started: 10 s from the later start
    v = hw.check(25.1)
    assert v and sorted(v.stalled) == [0, 1] and v.timeout_s == 10.0
    hw.on_step(0, 0, 20.0)                          # a first step 8 s after its start, not 20 s
    assert hw.warmup_timeout() == pol.hang_safety_factor * 8.0
    never = HangWatch(pol, ranks=range(2), started_at=0.0)
    assert never.check(39.9) is None and never.check(40.1) is not None    # 10 s + 30 s: lost report
    plain = HangWatch(Policy(hang_timeout_floor_s=1.0, worker_start_s=0.0), ranks=range(2), started_at=0.0)
    assert plain.check(10.1) is not None            # no start bound: the run's start, as before


def test_warmup_timeout_is_generous_then_calibrates():
    p = Policy(hang_timeout_floor_s=2.0, hang_safety_factor=5.0, hang_warmup_steps=3)
    hw = HangWatch(p, ranks=[0], started_at=0.0)
    assert not hw.calibrated and hw.timeout() == 20.0          # 10 x floor
    hw.on_step(0, 0, 8.0)                                       # 8 s to the first step
    assert hw.timeout() == 40.0                                 # 5 x 8 s > 20 s
    for s, t in ((1, 8.5), (2, 9.0), (3, 9.5)):
        hw.on_step(0, s, t)
    assert not hw.calibrated                                    # 3 warm-up intervals
    hw.on_step(0, 4, 10.0)
    assert hw.calibrated and hw.timeout() == 2.5                # 5 x 0.5 s
    assert HangWatch(Policy(hang_timeout_floor_s=2.0), warmup_factor=3.0).timeout() == 6.0


def test_hang_before_any_step_and_rank_that_never_reported():
    hw = HangWatch(Policy(), ranks=range(3), started_at=100.0)
    hw.on_started(range(3), 100.0)
    assert hw.check(199.0) is None
    v = hw.check(200.5)
    assert v and sorted(v.stalled) == [0, 1, 2] and v.waiting_step is None
    assert "no rank has reported a step" in v.reason
    hw2 = HangWatch(Policy(), ranks=range(3), started_at=0.0)
    hw2.on_started(range(3), 0.0)
    run_steps(hw2, [0, 1], 120, 1.0)          # ranks 0 and 1 step on, rank 2 is silent
    assert hw2.check(100.0) is None           # rank 2 still within the warm-up timeout
    v2 = hw2.check(101.0)
    assert v2 and v2.laggards == [2] and v2.stalled == {2: 0.0}


def test_non_sdk_worker_judged_on_activity():
    hw = HangWatch(Policy(hang_timeout_floor_s=1.0), started_at=0.0)
    prev = None
    cpu = 0.0
    for t in range(1, 30):
        cur = ActivitySample(cpu_s=cpu, log_bytes=100)
        if progressed(prev, cur):
            hw.on_activity(0, float(t))
        prev = cur
        cpu += 0.5 if t < 10 else 0.0           # CPU stops growing after t=10
        assert (hw.check(float(t)) is None) == (t <= 20), t
    assert hw.check(29.0).stalled == {0: 10.0}


def test_progressed_rules():
    a = ActivitySample(cpu_s=1.0, log_bytes=10)
    assert progressed(None, a)
    assert not progressed(a, ActivitySample(1.01, 10))
    assert progressed(a, ActivitySample(1.2, 10))
    assert progressed(a, ActivitySample(1.0, 11))
    assert progressed(a, ActivitySample(1.0, 0))       # rotated log
    with pytest.raises(ValueError):
        progressed(a, (1, 2))


def test_repeated_or_old_steps_are_not_progress_and_bad_input_is_refused():
    hw = HangWatch(Policy(), ranks=[0], started_at=0.0)
    hw.on_step(0, 5, 1.0)
    hw.on_step(0, 5, 50.0)                  # same step again: not progress
    assert hw.check(101.5) is not None
    with pytest.raises(ValueError, match="before its previous"):
        hw.on_step(0, 6, 0.5)               # a new step earlier than the last: refused
    hw.on_step(0, 4, 0.5)                   # an old report sent again: ignored, whatever its time
    for bad in (lambda: hw.on_step(-1, 0, 1.0), lambda: hw.on_step(0, "1", 1.0),
                lambda: hw.on_step(0, 1, float("nan")), lambda: hw.check(None),
                lambda: HangWatch(object()), lambda: HangWatch(Policy(), warmup_factor=0.5)):
        with pytest.raises(ValueError):
            bad()


def test_anomaly_nan_inf_and_jumps():
    assert anomaly([2.0, 1.9, float("nan")]) == "loss is nan at the latest step"
    assert "grad norm is inf" in anomaly([2.0, 1.9], [1.0, float("inf")])
    assert "grad norm is nan" in anomaly([2.0], float("nan"))
    losses = [3.0, 2.9, 2.8, 2.7, 2.75]
    assert anomaly(losses) is None
    why = anomaly(losses + [14.0])
    assert why and "loss jumped to 14" in why and "5.0x" in why
    assert anomaly(losses + [13.0]) is None                    # 4.8x < 5x
    assert anomaly(losses + [13.0], factor=4.0) is not None
    assert "grad norm jumped" in anomaly(losses, [1.0, 1.1, 0.9, 1.0, 6.0])
    assert anomaly([1.0, 50.0]) is None                        # too little history
    assert anomaly([1.0, float("nan"), 1.0, 1.0, 1.0]) is None  # old NaN is not the latest
    with pytest.raises(ValueError):
        anomaly([1.0], factor=1.0)
    with pytest.raises(ValueError):
        anomaly(["x"])


def test_nan_culprits_are_local_norms_mapped_to_machines():
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=1, dp=4)
    norms = {r: 1.0 for r in range(8)}
    norms[5] = math.nan
    norms[6] = math.inf
    assert nan_culprits(norms) == [5, 6]
    assert culprit_machines(norms, topo) == [2, 3]
    assert nan_culprits({0: 1.0}) == []
    with pytest.raises(ValueError):
        nan_culprits({0: None})


def test_a_finished_rank_is_never_stalled_and_the_others_count_their_activity_from_then():
    w = HangWatch(Policy(hang_timeout_floor_s=2.0, hang_warmup_steps=2), ranks=range(3), started_at=0.0)
    for k in range(1, 8):
        for r in range(3):
            w.on_step(r, k, k * 0.1)
    assert w.calibrated
    w.on_done(0)
    w.on_done(0)                            # (twice is once)
    w.on_activity(1, 2.5)                   # rank 1 computes on after the end of the steps
    v = w.check(3.5)
    assert v is not None and sorted(v.stalled) == [2]
    assert w.done() == [0]


def test_one_step_of_many_ranks_leaves_the_state_of_each_rank_in_turn():
    """`on_steps` (one step that many ranks reported at once) leaves every rank's marks, the
    calibration and the verdicts exactly as `on_step` rank by rank: through the warm-up steps and
    past them, with repeated and stale steps, a rank first seen, and a hang at the end."""
    pol = Policy(hang_timeout_floor_s=5.0, hang_safety_factor=3.0, hang_warmup_steps=3)
    one, many = HangWatch(pol, ranks=range(6), started_at=0.0), HangWatch(pol, ranks=range(6), started_at=0.0)
    t = 0.0
    for s in range(12):
        t += 1.0 + 0.1 * (s % 3)
        ranks = [r for r in range(6) if not (s == 7 and r == 2)] + ([6] if s == 9 else []) + ([1] if s == 4 else [])
        for r in ranks:
            one.on_step(r, s, t)
        many.on_steps(ranks, s, t)
        one.on_step(3, max(0, s - 1), t)       # stale: ignored by both
        many.on_steps([3], max(0, s - 1), t)
        assert saved(one) == saved(many), s
        assert one.check(t + 0.5) == many.check(t + 0.5)
    assert one.check(t + 100.0) == many.check(t + 100.0) is not None


def _same(arr, ref, where):
    assert saved(arr) == saved(ref), where
    assert arr.calibrated == ref.calibrated and arr.done() == ref.done(), where
    assert arr.timeout() == ref.timeout() and arr.warmup_timeout() == ref.warmup_timeout(), where


def test_the_arrays_hold_what_a_record_per_rank_does():
    """Random sequences of every operation (a rank's step, one step of many ranks with ranks listed
    twice, stale steps, ranks first seen and time running backwards, collectives, activity, a
    finished rank, a resume, workers reported started, checks at any time) leave `HangWatch`'s
    arrays with the marks, the calibration, the verdicts and the errors of the record per rank it replaced
    (`plainhang.PlainHangWatch`), and a saved state loads into the same watch."""
    from stalwart.controller.job.state import JobState, RunState, dumps, loads

    rng = random.Random(5)
    for trial in range(120):
        pol = Policy(hang_timeout_floor_s=rng.choice([1.0, 5.0]), hang_safety_factor=rng.choice([1.0, 3.0]),
                     hang_warmup_steps=rng.choice([0, 1, 3]), worker_start_s=rng.choice([0.0, 30.0]))
        world = rng.randrange(1, 7)
        listed = range(world) if rng.random() < 0.7 else rng.sample(range(9), world)
        start = rng.choice([None, 0.0])
        window = rng.choice([1, 3, 20])
        arr = HangWatch(pol, ranks=listed, started_at=start, window=window)
        ref = PlainHangWatch(pol, ranks=listed, started_at=start, window=window)
        _same(arr, ref, (trial, "new"))
        now, step = 0.0, 0
        for op in range(60):
            now += rng.choice([0.0, 0.1, 0.5, 1.0, 2.0, 7.0, 40.0])
            kind = rng.random()
            t = now - rng.choice([0.0, 0.0, 0.0, 3.0])         # now and then a report older than one seen
            calls = []
            if kind < 0.45:
                step += rng.choice([0, 1, 1, 1, 2])
                ranks = [r for r in range(world + 2) if rng.random() < 0.8]
                if rng.random() < 0.2 and ranks:
                    ranks.append(rng.choice(ranks))             # a rank listed twice
                if rng.random() < 0.3:
                    rng.shuffle(ranks)
                s = max(0, step - rng.choice([0, 0, 0, 1, 5]))
                listed = rng.choice([range(world), tuple(range(world)), tuple(ranks), ranks, ranks])
                calls = [("on_steps", (listed, s, t))]
            elif kind < 0.6:
                step += rng.choice([0, 1])
                calls = [("on_step", (rng.randrange(world + 2), max(0, step - rng.choice([0, 1])), t))]
            elif kind < 0.7:
                calls = [("on_collectives", (rng.randrange(world + 2), rng.randrange(0, 30), t))]
            elif kind < 0.8:
                calls = [("on_activity", (rng.randrange(world + 2), t))]
            elif kind < 0.84:
                calls = [("on_done", (rng.randrange(world + 2),))]
            elif kind < 0.87:
                calls = [("resume", (now,))]
            elif kind < 0.92:
                calls = [("on_started", ([r for r in range(world + 2) if rng.random() < 0.5], t))]
            for name, args in calls:
                outcome = []
                for w in (arr, ref):
                    try:
                        getattr(w, name)(*args)
                        outcome.append(None)
                    except ValueError as e:
                        outcome.append(str(e))
                assert outcome[0] == outcome[1], (trial, op, name, args)
            a, b = arr.check(now), ref.check(now)
            assert a == b, (trial, op)
            _same(arr, ref, (trial, op))
        st = JobState(job_id=1, created_at=0.0)
        st.run = RunState(seq=1, started_at=0.0, start_step=0, restore_step=-1, machines=[], hang=arr)
        back = loads(dumps(st)).run.hang
        assert back is not None and saved(back) == saved(arr) and dumps(loads(dumps(st))) == dumps(st)
        later = now + 1000.0
        assert back.check(later) == arr.check(later) == ref.check(later)
