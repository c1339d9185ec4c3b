"""Job-core behaviour the cluster simulator brought to light (each fixed in the core, for the
controller as much as for the simulator)."""
from corekit import NAN, Harness, of, records
from stalwart import protocol as p
from stalwart.controller.job import actions as a
from stalwart.controller.job.state import JobPhase


def crash(h: Harness, rank: int = 2) -> None:
    h.agent(h.machine_of(rank), p.WorkerExit(run=h.st.run_seq, rank=rank, code=-9, signal=9, t=h.now))


def test_after_a_nan_the_next_run_s_own_steps_are_restored_again():
    """A NaN marks its steps as never to be restored; once its run stopped, the steps the next run
    trains are good. (The mark used to cover 10,000 steps: every restore for hours went back
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
    assert h.st.is_bad(5) and not h.st.is_bad(24)


def test_a_replay_failing_in_every_group_blames_no_machine():
    """Faulty code fails the replay everywhere: the intersection of the failing groups is every
    machine, and evicting it would end the job. Nobody is evicted."""
    h = Harness(machines=4, gpus=1, standby=1, steps=500,
                policy={"alignment_test": False, "replay_k": 2, "replay_steps": 2})
    h.tick()
    h.steps(3)
    for attempt in range(2):
        h.step(loss=NAN)
        h.stopped()
        acts = h.advance(2.0)
        if attempt == 0:
            h.steps(2)
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
