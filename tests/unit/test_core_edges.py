"""Job-core decisions at the edges of their rules: restores after a NaN, a replay that fails in
every group, the hang watch's shortcut against its full computation."""
from corekit import NAN, Harness, of, records
from stalwart import protocol as p
from stalwart.controller.job import actions as a
from stalwart.controller.job.state import JobPhase


def crash(h: Harness, rank: int = 2) -> None:
    h.agent(h.machine_of(rank), p.WorkerExit(run=h.st.run_seq, rank=rank, code=-9, signal=9, t=h.now))


def test_after_a_nan_the_next_run_s_own_steps_are_restored_again():
    """A NaN marks its steps as never to be restored; once its run stopped, the steps the next run
    trains are good. (A mark covering every later step would send each restore for hours back
    before the NaN, redoing all the progress since.)"""
    h = Harness(machines=2, gpus=2, standby=1, steps=500)
    h.tick()
    h.steps(5)
    h.ckpt(4)
    h.step(loss=NAN)                            # step 5 is corrupted
    h.stopped()
    acts = h.advance(2.0)
    assert of(acts, a.StartRun)[0].restore_step == 4
    h.steps(20)
    h.ckpt(24)
    crash(h)
    checks = of(h.stopped(), a.RunChecks)[0]
    acts = h.diag(checks)
    assert of(acts, a.StartRun)[0].restore_step == 24
    assert not h.st.is_bad(24)          # the range closed at the restart and lapsed since (BadSteps)


def test_a_replay_failing_in_every_group_blames_no_machine():
    """Faulty code fails the replay everywhere: the intersection of the failing groups is every
    machine, and evicting it would end the job. Nobody is evicted."""
    h = Harness(machines=4, gpus=1, standby=1, steps=500,
                policy={"alignment_test": False, "replay_k": 2, "replay_steps": 2})
    h.tick()
    acts = h.nan_twice()
    for _ in range(2):              # both phases: every group reports a NaN
        groups = of(acts, a.StartReplayGroup)
        assert groups and h.st.phase == JobPhase.REPLAYING
        acts = []
        for g in groups:
            acts += h.agent(g.machines[0], p.Step(run=g.run, rank=0, step=0, t=h.now, loss=NAN))
    done = records(acts, "replay_done")[0]
    assert done["machines"] == []
    assert not [x for x in of(acts, a.AssignMachine) if x.state == "evicted"]
    assert of(acts, a.StartRun) and "every group" in h.st.history[-1].cause


def test_the_hang_watch_s_shortcut_gives_the_verdicts_of_a_full_look():
    """HangWatch.check skips the look at every rank while nobody can have passed the floor
    timeout, or while nothing was reported since a look that saw nobody due yet: random step,
    activity and resume sequences get the same verdicts with and without the shortcuts."""
    import random

    from stalwart.controller.rules.hangwatch import HangWatch
    from stalwart.spec import Policy
    for seed in range(30):
        rng = random.Random(seed)
        pol = Policy(hang_timeout_floor_s=rng.choice([1.0, 5.0]), hang_warmup_steps=rng.choice([0, 2]))
        fast, full = (HangWatch(pol, ranks=range(4), started_at=0.0) for _ in range(2))
        steps = [0] * 4
        now = 0.0
        for _ in range(300):
            now += rng.choice([0.2, 0.2, 1.0, 3.0, 8.0, 30.0])
            r, what = rng.randrange(5), rng.random()
            for w in (fast, full):
                if what < 0.5 and r < 4:
                    w.on_step(r, steps[r] + 1, now)
                elif what < 0.6 and r < 4:
                    w.on_activity(r, now)
                elif what < 0.62:
                    w.resume(now)
            if what < 0.5 and r < 4:
                steps[r] += 1
            full._lower = full._quiet_until = None      # the full look, every time
            a, b = fast.check(now), full.check(now)
            assert (a is None) == (b is None) and (a is None or a.stalled == b.stalled), (seed, now)
