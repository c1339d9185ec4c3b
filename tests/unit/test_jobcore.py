"""The job core without processes: a fake clock and fake agents drive it through every flow, and
the tests assert the actions it decides (the state is saved and reloaded after every event)."""
import pytest

from corekit import NAN, Harness, kinds, of, records
from stalwart import protocol as p
from stalwart.controller.job import actions as a
from stalwart.controller.job import state as S
from stalwart.controller.job.events import (AgentEvents, Cancel, Inject, MachineLost, StepReport, StopReport,
                                            VersionRegistered)
from stalwart.controller.job.state import JobPhase, TransitionError


def started(h: Harness) -> Harness:
    acts = h.tick()
    assert kinds(acts)[:2] == ["AssignMachine", "AssignMachine"]
    assert of(acts, a.StartRun)[0].slots == [f"m{i}" for i in range(h.spec.machines)]
    assert h.st.phase == JobPhase.RUNNING
    return h


def test_waits_for_machines_then_starts_with_warm_standbys():
    h = Harness(machines=2, standby=1)
    h.cluster.dead |= {"m2"}
    assert h.tick() == []                                    # 2 free, 3 wanted: wait
    h.cluster.dead.clear()
    acts = h.tick()
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [
        ("m0", "active"), ("m1", "active"), ("m2", "standby")]
    assert of(acts, a.Prewarm) == []          # not yet: the first start has the CPUs to itself
    run = of(acts, a.StartRun)[0]
    assert (run.run, run.restore_step, run.warm) == (1, -1, [])
    assert records(acts, "run_started") == [{"run": 1, "start_step": 0, "machines": ["m0", "m1"]}]
    assert [x.machine for x in of(h.step(), a.Prewarm)] == ["m2"]      # the first step is done
    assert of(h.step(), a.Prewarm) == []
    assert h.core.live(h.st)["standby_warm"] == []          # spawned, still importing
    h.agent("m2", p.StandbyReady(pid=11))
    h.agent("m2", p.StandbyReady(pid=11))                   # (the same worker twice counts once)
    h.agent("m0", p.StandbyReady(pid=12))                   # an active machine's spare: not the pool's
    assert h.core.live(h.st)["standby_warm"] == []
    h.agent("m2", p.StandbyReady(pid=13))
    assert h.core.live(h.st)["standby_warm"] == ["m2"]      # every worker of m2 waits at the barrier
    assert h.core.live(h.st)["spares_warm"] == []
    h.agent("m0", p.StandbyReady(pid=14))                   # m0's second spare: its next restart is warm
    assert h.core.live(h.st)["spares_warm"] == ["m0"]
    crash(h, rank=0)
    checks = of(h.stopped(), a.RunChecks)[0]
    assert of(h.diag(checks), a.StartRun)                   # the reattempt takes m0's spares
    assert h.core.live(h.st)["spares_warm"] == [] and h.core.live(h.st)["standby_warm"] == ["m2"]


def test_the_runs_start_up_is_recorded_once_every_rank_said_hello():
    h = started(Harness())
    acts = []
    for r in range(h.world):
        acts += h.agent(h.machine_of(r), p.Hello(run=1, rank=r, imported=h.now + r, ready=h.now + 2 * r))
        acts += h.agent(h.machine_of(r), p.Hello(run=1, rank=r, imported=h.now, ready=h.now))   # again
    assert records(acts, "workers_ready") == [{"run": 1, "imported": h.now + 3, "ready": h.now + 6}]


def test_steps_commit_when_every_rank_reported_and_the_job_ends():
    h = started(Harness(steps=3))
    assert records(h.step(skip={3}), "step") == []          # rank 3 still missing
    h.agent("m1", p.Step(run=1, rank=3, step=0, t=h.now, dur=0.1, loss=1.0))
    assert h.st.steps_done == 1
    h.steps(2)
    acts = []
    for r in range(4):
        acts += h.agent(h.machine_of(r), p.Done(run=1, rank=r))
    assert h.st.phase == JobPhase.SUCCEEDED
    assert of(acts, a.FinishJob)[0].state == "succeeded"
    assert kinds(acts)[-3:] == ["UpdateRun", "Record:job_finished", "FinishJob"]


def test_step_reports_sent_again_after_newer_ones_are_ignored_not_a_failure():
    """An agent resends the batches it had no ack for after a reconnect (agent/link.py): a step
    report may come twice, even behind the same rank's newer steps. It is no new step (no second
    commit, no pending step that never completes) and no time running backwards (the hang timer
    refused that: the job failed with an internal error)."""
    h = started(Harness(steps=50))
    old = [p.Step(run=1, rank=r, step=0, t=h.now + 0.1, dur=0.1, loss=1.0) for r in range(4)]
    h.step()
    h.steps(3)
    assert h.st.steps_done == 4 and h.st.run.last_committed == 3
    acts = []
    for ev in old:                                   # step 0 again, after steps 1-3
        acts += h.agent(h.machine_of(ev.rank), ev)
    assert records(acts, "step") == [] and h.st.phase == JobPhase.RUNNING
    assert h.st.run.pending == {} and h.st.steps_done == 4
    # a step still pending (rank 3 is behind) sent again by rank 0 after rank 0's next one
    h.step(skip={3})
    h.agent("m0", p.Step(run=1, rank=0, step=5, t=h.now + 1.0, dur=0.1, loss=1.0))
    acts = h.agent("m0", p.Step(run=1, rank=0, step=4, t=h.now, dur=0.1, loss=1.0))
    assert h.st.phase == JobPhase.RUNNING and records(acts, "step") == []
    h.agent("m1", p.Step(run=1, rank=3, step=4, t=h.now + 0.5, dur=0.1, loss=1.0))
    assert h.st.steps_done == 5


def test_a_machines_merged_step_reports_commit_like_its_ranks_reports():
    """An agent sends its ranks' reports of a step as one `steps` message (protocol.merge_steps):
    the job counts each rank, exactly as from separate reports."""
    h = started(Harness(steps=3))
    for step in range(2):
        events = [{"type": "step", "run": 1, "rank": r, "step": step, "t": h.now + 0.1, "dur": 0.1,
                   "loss": 2.0, "compute_s": 0.05} for r in range(4)]
        by_machine: dict[str, list] = {}
        for ev in events:
            by_machine.setdefault(h.machine_of(ev["rank"]), []).append(ev)
        for m, evs in by_machine.items():
            [merged] = p.merge_steps(evs)
            assert merged["type"] == "steps" and len(merged["ranks"]) == 2
            assert step == h.st.steps_done              # not committed before the last machine's
            h.agent(m, p.decode_event(merged))
        assert h.st.steps_done == step + 1
    assert h.st.run is not None and h.st.run.committed == 2


def test_merge_steps_keeps_every_other_event_in_place():
    st = lambda r, s: {"type": "step", "run": 2, "rank": r, "step": s, "t": float(s), "loss": 1.5}  # noqa: E731
    exit_ = {"type": "worker_exit", "run": 2, "rank": 1, "code": 1}
    out = p.merge_steps([st(0, 5), st(1, 5), st(0, 6), exit_, st(1, 6), {"type": "metrics"}])
    assert [e["type"] for e in out] == ["steps", "step", "worker_exit", "step", "metrics"]
    # nothing moves: rank 1's step 5 never overtakes its step 4 (time would run backwards)
    lag = p.merge_steps([st(0, 5), st(1, 4), st(1, 5), st(0, 6), st(1, 6)])
    assert [(e["type"], e["step"]) for e in lag] == [("step", 5), ("step", 4), ("step", 5), ("steps", 6)]
    assert out[0]["step"] == 5 and [r["rank"] for r in out[0]["ranks"]] == [0, 1]
    assert out[0]["ranks"][0] == {"rank": 0, "t": 5.0, "loss": 1.5}
    expanded = p.decode_event(out[0]).expand()
    assert [(s.rank, s.step, s.loss, s.run) for s in expanded] == [(0, 5, 1.5, 2), (1, 5, 1.5, 2)]
    assert p.merge_steps([]) == [] and p.merge_steps(out) == out       # merged once is merged


def crash(h: Harness, rank: int = 2, code: int = -9) -> list:
    return h.agent(h.machine_of(rank), p.WorkerExit(run=h.st.run_seq, rank=rank, code=code, signal=9,
                                                    t=h.now, log_tail=""))


def test_crash_without_culprit_runs_stop_time_checks_then_reattempts_from_memory():
    h = started(Harness())
    h.steps(5)
    h.ckpt(4)
    acts = crash(h)
    assert kinds(acts) == ["OpenIncident", "Record:incident_opened", "StopWorkers"]
    assert h.st.phase == JobPhase.RECOVERING
    acts = h.stopped()               # the worker's own death is the cause in hand: no settling
    checks = of(acts, a.RunChecks)[0]
    assert checks.checks == ["selftest", "intra", "inter"] and checks.machines == ["m0", "m1"]
    assert h.st.phase == JobPhase.DIAGNOSING
    acts = h.diag(checks)
    run = of(acts, a.StartRun)[0]
    assert (run.run, run.restore_step) == (2, 4)
    assert [c.tier for c in run.restore[0]] == ["own", "backup"]
    upd = [x for x in of(acts, a.UpdateIncident) if "mechanism" in x.fields][0].fields
    assert upd["mechanism"] == "reattempt" and upd["evicted"] == [] and upd["suspects"] == ["m1"]
    acts = h.step()
    assert records(acts, "incident_resumed") == [{"incident": 1}]


def test_a_failing_check_evicts_that_machine_for_a_standby():
    h = started(Harness())
    h.steps(3)
    crash(h)
    checks = of(h.stopped(), a.RunChecks)[0]
    acts = h.diag(checks, bad={"m1": "matmul wrong"})
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m1", "evicted"), ("m2", "active")]
    assert "m1: selftest failed" in of(acts, a.AssignMachine)[0].reason
    run = of(acts, a.StartRun)[0]
    assert run.slots == ["m0", "m2"] and run.warm == ["m2"]


def test_a_machine_lost_during_the_checks_is_evicted_and_its_partner_is_not_blamed():
    h = started(Harness())
    h.steps(3)
    crash(h)                                  # machine-down: the crash is seen before the silence
    assert of(h.stopped(), a.RunChecks)
    h.cluster.dead.add("m1")
    acts = h.event(MachineLost(machine="m1"))
    assert records(acts, "machine_lost") == [{"machine": "m1", "incident": 1}]
    assert records(acts, "checks_done")[0]["aborted"] == "m1 lost"       # no waiting for its partner
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m1", "evicted"), ("m2", "active")]
    upd = [x for x in of(acts, a.UpdateIncident) if "mechanism" in x.fields][0].fields
    assert (upd["symptom"], upd["evicted"], upd["mechanism"]) == ("machine_lost", ["m1"], "evict_restart")
    assert of(acts, a.StartRun)[0].slots == ["m0", "m2"]


def test_a_machine_whose_checks_died_without_a_result_is_the_one_evicted():
    h = started(Harness())
    h.steps(3)
    crash(h)
    checks = of(h.stopped(), a.RunChecks)[0]
    h.agent("m0", p.DiagResult(id=checks.name, results=[
        {"check": "selftest", "ok": True, "detail": "ok", "measure": {"gflops": 10.0}},
        {"check": "intra", "ok": True, "detail": "ok", "measure": {}}] + [
        {"check": "inter", "ok": False, "detail": "peer m1 did not join", "round": x.round, "peer": x.peer,
         "measure": {}} for x in checks.inter_of("m0")]))
    acts = h.agent("m1", p.DiagResult(id=checks.name, results=[]))     # its check process was killed
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m1", "evicted"), ("m2", "active")]
    assert "produced no result" in of(acts, a.AssignMachine)[0].reason

def test_checks_that_time_out_on_every_machine_evict_nobody_and_the_crash_is_reattempted():
    """A host too loaded for the checks' bound: nobody finishes, nobody is blamed for it."""
    h = started(Harness())
    h.steps(3)
    crash(h)
    assert of(h.stopped(), a.RunChecks)
    acts = h.advance(h.st.diag.deadline - h.now + 1.0)
    assert not of(acts, a.AssignMachine)
    upd = [x for x in of(acts, a.UpdateIncident) if "mechanism" in x.fields][0].fields
    assert (upd["mechanism"], upd["evicted"]) == ("reattempt", [])
    assert "stop-time checks inconclusive: none of the 2 machines finished its checks in time" in upd["cause"]
    assert of(acts, a.StartRun)[0].slots == ["m0", "m1"]


def test_lost_machine_is_replaced_without_checks():
    h = started(Harness())
    h.steps(3)
    h.ckpt(2)
    h.cluster.dead.add("m1")
    acts = h.event(MachineLost(machine="m1"))
    assert kinds(acts)[:3] == ["OpenIncident", "Record:incident_opened", "StopWorkers"]
    acts = h.stopped(["m0"])                 # the last live one: localized at once
    assert not of(acts, a.RunChecks)
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m1", "evicted"), ("m2", "active")]
    run = of(acts, a.StartRun)[0]
    assert run.restore_step == 2 and run.slots == ["m0", "m2"]
    assert {c.tier for r in (2, 3) for c in run.restore[r]} == {"backup"}     # m1's own copies are gone


def test_a_step_whose_reports_died_with_a_machine_is_done_when_every_rank_restores_after_it():
    """m1's reports of step 3 never came (they died with it, or waited in its agent's outbox), but
    every rank holds a copy of step 3: the run restarts after it, and step 3 is recorded with what
    the reports that came say, not lost nor trained again."""
    h = started(Harness())
    h.steps(3)
    h.step(loss=1.5, skip={2, 3})
    h.ckpt(3)
    h.cluster.dead.add("m1")
    h.event(MachineLost(machine="m1"))
    acts = h.stopped(["m0"])
    run = of(acts, a.StartRun)[0]
    assert run.restore_step == 3
    [rec] = [x for x in acts if isinstance(x, a.Record) and x.kind == "step"]
    assert rec.data["step"] == 3 and rec.data["loss"] == 1.5 and rec.data["run"] == 1
    assert h.st.steps_done == 4 and h.st.best_steps == 4
    assert [x.kind for x in acts if isinstance(x, a.Record)].index("step") \
        < [x.kind for x in acts if isinstance(x, a.Record)].index("run_started")


def test_no_standby_fails_the_job_with_the_reason():
    h = started(Harness(standby=0))
    h.steps(2)
    h.cluster.dead.add("m1")
    h.event(MachineLost(machine="m1"))
    acts = h.stopped(["m0"])
    assert h.st.phase == JobPhase.FAILED
    assert "only 0 standby machine(s) ready" in of(acts, a.FinishJob)[0].reason


def test_hang_traces_stacks_then_evicts_the_stopped_worker_machine():
    h = started(Harness(policy={"hang_timeout_floor_s": 2.0}))
    h.steps(10)
    acts = h.advance(3.0)
    assert of(acts, a.TraceStacks)[0].machines == ["m0", "m1"]
    assert h.st.phase == JobPhase.TRACING
    worker = {"role": "worker", "threads": [], "status": "sleeping"}
    h.agent("m0", p.Stacks(run=1, records=[dict(worker, rank=0), dict(worker, rank=1)]))
    acts = h.agent("m1", p.Stacks(run=1, records=[dict(worker, rank=2, status="stopped"),
                                                  dict(worker, rank=3)]))
    assert records(acts, "incident_traced") == [{"incident": 1, "machines": ["m1"]}]
    assert of(acts, a.StopWorkers) and h.st.phase == JobPhase.RECOVERING
    acts = h.stopped() + h.advance(2.0)          # an implicit symptom: its evidence settles first
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m1", "evicted"), ("m2", "active")]


def test_a_rank_stuck_after_the_others_finished_ends_the_job_as_succeeded_not_a_restart():
    """Three ranks exited 0 and the fourth stopped making progress: the training is over and rank
    3 is stuck on its way out (torch's process-group teardown can deadlock). The job ends as
    succeeded, rank 3's worker is stopped, and a record names it; no incident, no restart."""
    h = started(Harness(policy={"hang_timeout_floor_s": 2.0}))
    h.steps(10)
    for s in (10, 11):              # the last two steps: rank 3's reports never come
        for r in (0, 1, 2):
            h.agent(h.machine_of(r), p.Step(run=1, rank=r, step=s, t=h.now, dur=0.1, loss=1.0))
    for r in (0, 1, 2):
        h.agent(h.machine_of(r), p.WorkerExit(run=1, rank=r, code=0, t=h.now))
    assert h.st.phase == JobPhase.RUNNING and h.st.steps_done == 10
    acts = h.advance(3.0)
    assert [x["step"] for x in records(acts, "step")] == [10, 11] and h.st.steps_done == 12
    assert of(acts, a.TraceStacks) == [] and of(acts, a.OpenIncident) == []
    assert h.st.phase == JobPhase.SUCCEEDED
    (rec,) = records(acts, "exit_hang")
    assert (rec["ranks"], rec["machines"], rec["done"]) == ([3], ["m1"], [0, 1, 2])
    assert "m1" in of(acts, a.StopWorkers)[0].machines
    assert "rank(s) [3] on m1 stuck" in of(acts, a.FinishJob)[0].reason


def test_after_some_ranks_finished_one_still_working_is_waited_for_then_the_stuck_one_ends():
    """Once a rank exited 0 no step comes any more: a rank still computing (its own last save) is
    active, not stalled, and the job waits for it; only then is the stuck one judged."""
    h = started(Harness(policy={"hang_timeout_floor_s": 2.0}))
    h.steps(10)
    for r in (0, 1):
        h.agent(h.machine_of(r), p.WorkerExit(run=1, rank=r, code=0, t=h.now))
    acts = []
    for _ in range(25):                     # rank 2 keeps computing, rank 3 does not
        acts += h.advance(0.2) + h.agent("m1", p.Activity(run=1, ranks=[2]))
    assert h.st.phase == JobPhase.RUNNING and of(acts, a.TraceStacks) == []
    h.agent("m1", p.WorkerExit(run=1, rank=2, code=0, t=h.now))
    acts = h.advance(0.4)
    assert h.st.phase == JobPhase.SUCCEEDED
    assert [r["ranks"] for r in records(acts, "exit_hang")] == [[3]]


def test_with_no_rank_finished_a_rank_computing_without_steps_is_still_a_hang():
    """The rule above starts only once a rank finished: before that, a calibrated timer counts
    steps only (a rank spinning in a stuck collective burns CPU)."""
    h = started(Harness(policy={"hang_timeout_floor_s": 2.0}))
    h.steps(10)
    acts = []
    for _ in range(15):
        acts += h.advance(0.2) + h.agent("m1", p.Activity(run=1, ranks=[2, 3]))
    assert h.st.phase == JobPhase.TRACING and of(acts, a.TraceStacks)


def test_nan_with_a_named_rank_evicts_its_machine():
    h = started(Harness())
    h.steps(5)
    h.ckpt(3)
    acts = h.step(loss=NAN, local={2: float("inf")})
    assert of(acts, a.OpenIncident)[0].symptom == "nan"
    acts = h.stopped()              # the named machine is the evidence: no wait for more
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m1", "evicted"), ("m2", "active")]
    assert of(acts, a.StartRun)[0].restore_step == 3          # never the corrupted step


def test_the_steps_after_a_nan_are_restorable_again_once_a_later_run_rewrote_them():
    h = started(Harness(spare=1))
    h.steps(5)
    for s in (3, 4):
        h.ckpt(s)
    h.step(loss=NAN, local={2: float("inf")})           # step 5: the bad run's copy of 5
    h.ckpt(5)
    assert of(h.stopped() + h.advance(2.0), a.StartRun)[0].restore_step == 4
    # the new run trains 5, 6 ... again: until it is well past 5 (the bad run's newest copy), a copy
    # of 5 may still be the bad run's (a backup that trailed), so 5 is not restored
    h.steps(2)
    h.ckpt(5)
    crash(h)
    checks = of(h.stopped(), a.RunChecks)[0]
    run = of(h.diag(checks), a.StartRun)[0]
    assert run.restore_step == 4
    # once it has gone past them (and the slots a backup trails by), its own copies count
    h.steps(12)
    last = h.st.steps_done - 1
    h.ckpt(last)
    assert h.st.bad_steps == []
    crash(h)
    checks = of(h.stopped(), a.RunChecks)[0]
    assert of(h.diag(checks), a.StartRun)[0].restore_step == last


def test_training_past_a_nan_again_is_progress_and_crashes_short_of_the_best_step_are_not():
    h = started(Harness(spare=1))
    h.steps(10)
    h.ckpt(3)
    h.step(loss=NAN, local={2: float("inf")})             # step 10 is bad; the run trains on a little
    h.steps(3)
    assert of(h.stopped() + h.advance(2.0), a.StartRun)[0].restore_step == 3
    h.steps(7)                          # steps 4..10: a good step 10 is new (the bad one was no progress)
    h.ckpt(10)
    crash(h)
    assert of(h.diag(of(h.stopped(), a.RunChecks)[0]), a.StartRun)
    assert h.st.restarts_without_progress == 0
    for n in (1, 2, 3):                                      # runs that die before a new step: a crash loop
        crash(h)
        acts = h.stopped() + h.advance(2.0)
        acts += h.diag(of(acts, a.RunChecks)[0]) if of(acts, a.RunChecks) else []
        acts += h.advance(2.0)
        assert h.st.restarts_without_progress == n, kinds(acts)
    assert "no progress across 3 restarts" in of(acts, a.FinishJob)[0].reason


def test_a_restart_from_further_back_forgets_the_signals_of_the_steps_it_trains_again():
    h = started(Harness())
    h.steps(10)
    h.ckpt(3)
    assert len(h.st.signals.loss_hist) == 10
    crash(h)
    run = of(h.diag(of(h.stopped(), a.RunChecks)[0]), a.StartRun)[0]
    assert run.restore_step == 3 and len(h.st.signals.loss_hist) == 4        # steps 0..3


def test_fail_slow_rounds_evict_the_rank_that_computes_slowly():
    h = started(Harness(machines=4, gpus=1, standby=1, steps=500,
                        policy={"failslow_rounds": 3, "failslow_period_s": 1.0}))
    h.steps(30, dur=0.1)
    slow = {2: 0.38}                       # its peers compute 0.2 s of each 0.4 s step
    acts = h.steps(6, dur=0.4, compute=slow)
    assert records(acts, "failslow_suspected")
    traces = 0
    for _ in range(200):
        acts = h.step(dur=0.4, compute=slow)
        for t in of(acts, a.TraceStacks):
            traces += 1
            for m in t.machines:
                rank = int(m[1:])
                h.agent(m, p.Stacks(run=h.st.run_seq, records=[{"rank": rank, "role": "worker", "threads": [],
                                                                  "status": "running"}]))
        if h.st.incident is not None:
            break
    assert traces >= 2 and len(records(h.log, "failslow_round")) >= 3
    assert h.st.incident.symptom == "fail_slow" and h.st.incident.implicit_evict == ["m2"]


def test_stop_time_checks_then_replay_isolate_a_silent_corrupter():
    h = started(Harness(machines=4, gpus=1, standby=1, steps=500,
                        policy={"alignment_test": False, "replay_k": 2, "replay_steps": 2}))
    h.steps(3)
    for attempt in range(2):
        h.step(loss=NAN)
        h.stopped()
        acts = h.advance(2.0)
        assert not of(acts, a.RunChecks)         # a NaN with alignment off: no check applies
        if attempt == 0:
            assert of(acts, a.StartRun)            # first time: reattempt
            h.steps(2)
    groups = of(acts, a.StartReplayGroup)
    assert [g.machines for g in groups] == [["m0", "m1"], ["m2", "m3"]]
    assert h.st.phase == JobPhase.REPLAYING

    def play(groups, bad_machine):
        out = []
        for g in groups:
            for i, m in enumerate(g.machines):
                if bad_machine in g.machines:
                    out += h.agent(m, p.Step(run=g.run, rank=i, step=0, t=h.now, loss=NAN))
                else:
                    out += h.agent(m, p.Done(run=g.run, rank=i))
        return out
    acts = play(groups, "m2")
    vertical = of(acts, a.StartReplayGroup)
    assert [g.machines for g in vertical] == [["m0", "m2"], ["m1", "m3"]]
    acts = play(vertical, "m2")
    assert records(acts, "replay_done")[0]["machines"] == ["m2"]
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m2", "evicted"), ("m4", "active")]


def test_a_replay_phase_ends_with_its_last_group_in_any_order():
    """The phase ends when its last running group ends, whatever the order its groups' workers
    report in, with reports after a group ended and with the count of running groups lost (a
    state saved before it was kept) and made again."""
    import random
    for seed in range(6):
        rng = random.Random(seed)
        h = started(Harness(machines=8, gpus=1, standby=1, steps=500,
                            policy={"alignment_test": False, "replay_k": 2, "replay_steps": 2}))
        groups = of(h.nan_twice(), a.StartReplayGroup)
        assert len(groups) == 4 and h.st.phase == JobPhase.REPLAYING
        events = [(g, m, i) for g in groups for i, m in enumerate(g.machines)]
        rng.shuffle(events)
        events += events[:3]                    # reports after their group ended change nothing
        failing = rng.choice(groups).run
        waiting = {g.run: set(range(len(g.machines))) for g in groups}
        running = set(waiting)
        for n, (g, m, i) in enumerate(events):
            if n == 3:
                h.st.replay.running = -1
            ev = p.WorkerExit(run=g.run, rank=i, code=1) if g.run == failing else p.Done(run=g.run, rank=i)
            acts = h.agent(m, ev)
            waiting[g.run].discard(i)
            was_running = bool(running)
            if g.run == failing or not waiting[g.run]:
                running.discard(g.run)
            assert bool(records(acts, "replay_phase_done")) == (was_running and not running), (seed, n)
        assert len(records(h.log, "replay_phase_done")) == 1, seed


def test_a_machine_lost_during_a_replay_ends_it_and_is_evicted():
    h = started(Harness(machines=4, gpus=1, standby=1, steps=500,
                        policy={"alignment_test": False, "replay_k": 2, "replay_steps": 2}))
    groups = of(h.nan_twice(), a.StartReplayGroup)
    assert h.st.phase == JobPhase.REPLAYING
    h.cluster.dead.add("m3")
    acts = h.event(MachineLost(machine="m3"))
    assert sorted(x.run for x in of(acts, a.StopWorkers) if x.run is not None) == sorted(g.run for g in groups)
    assert records(acts, "replay_done")[0]["machines"] == ["m3"]
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m3", "evicted"), ("m4", "active")]
    assert h.st.phase == JobPhase.RUNNING and of(acts, a.StartRun)[0].slots == ["m0", "m1", "m2", "m4"]


def version(i: int, status: str, mode: str = "lazy", path: str | None = None) -> dict:
    return {"id": i, "job_id": 1, "hash": f"{i:064x}", "path": path or f"/v/{i}", "source": "/code",
            "status": status, "mode": mode, "window_s": 86400.0, "created_at": 0.0,
            "applied_at": 0.0 if status == "stable" else None, "applied_step": 0 if status == "stable" else None,
            "reason": None}


def test_urgent_hot_update_warms_spares_then_restarts_in_place_on_the_new_code():
    h = started(Harness(versions=[version(1, "stable")]))
    h.steps(5)
    h.ckpt(4)
    acts = h.event(VersionRegistered(row=version(2, "urgent", "urgent")))
    assert records(acts, "version_registered")[0]["version"] == 2
    acts = h.tick()
    assert of(acts, a.PrepareSpares)[0].code_path == "/v/2" and not of(acts, a.OpenIncident)
    h.agent("m0", p.SparesReady(key="/v/2"))
    acts = h.agent("m1", p.SparesReady(key="/v/2"))
    assert records(acts, "version_prewarmed")
    acts = h.tick()
    assert of(acts, a.OpenIncident)[0].symptom == "hot_update"
    acts = h.stopped()                        # planned: no settle, no checks
    run = of(acts, a.StartRun)[0]
    assert run.code_path == "/v/2" and run.version == 2 and run.restore_step == 4
    saved = {x.row["id"]: x.row["status"] for x in of(acts, a.SaveVersion)}
    assert saved == {2: "applied"}
    assert [x.fields["mechanism"] for x in of(acts, a.UpdateIncident)] == ["hot_update"]


def test_user_error_after_an_update_rolls_back_to_the_last_stable_version():
    h = started(Harness(versions=[version(1, "stable"), dict(version(2, "applied"), applied_at=1.0,
                                                                applied_step=0)]))
    h.st.version_id, h.st.code_path = 2, "/v/2"
    h.steps(2)
    tail = 'Traceback (most recent call last):\n  File "/v/2/train.py", line 3, in <module>\nValueError: bad\n'
    h.agent("m0", p.WorkerExit(run=1, rank=0, code=1, t=h.now, log_tail=tail))
    acts = h.stopped()
    assert {x.row["id"]: x.row["status"] for x in of(acts, a.SaveVersion)} == {2: "rolled-back"}
    assert of(acts, a.StartRun)[0].code_path == "/v/1"
    assert records(acts, "version_rolled_back")


def test_injection_cancel_and_transitions():
    h = started(Harness())
    acts = h.event(Inject(kind="gpu-xid", machine=1, params={"code": 79}))
    assert of(acts, a.SendChaos)[0].machine == "m1"
    with pytest.raises(TransitionError):
        h.st.move(JobPhase.DIAGNOSING)               # running -> diagnosing skips the stop
    acts = h.event(Cancel(reason="enough"))
    assert h.st.phase == JobPhase.CANCELLED and of(acts, a.FinishJob)[0].reason == "enough"
    assert h.tick() == []                            # a finished job decides nothing more


def test_scheduled_faults_are_armed_with_their_step_at_the_first_commit():
    from stalwart.controller.job.state import ChaosPlan
    h = Harness(steps=40)
    h.st.chaos = [ChaosPlan(kind="crash", machine=1, rank=None, step=30, params={}),
                  ChaosPlan(kind="nan", machine=0, rank=None, step=35, params={})]
    h = started(h)
    acts = h.steps(1)
    sent = of(acts, a.SendChaos)
    # sent at once, armed: the agent applies each when its own ranks completed that many steps
    assert [(c.machine, c.kind, c.at_step, c.step) for c in sent] == [("m1", "crash", 30, 30), ("m0", "nan", 35, 35)]
    assert h.st.chaos == [] and len(records(acts, "chaos_sent")) == 2
    assert of(h.steps(3), a.SendChaos) == []          # sent once
    # an injection now is not armed
    assert of(h.event(Inject(kind="gpu-xid", machine=1, params={})), a.SendChaos)[0].at_step is None


def test_an_armed_fault_goes_off_when_a_rank_of_its_machine_completed_its_step():
    from stalwart.agent.armed import ArmedChaos
    armed = ArmedChaos()
    armed.arm(p.Chaos(kind="crash", step=30, at_step=30))
    armed.arm(p.Chaos(kind="nan", step=32, at_step=32))
    assert armed.due({}) == [] and armed.due({2: 28, 3: 27}) == []
    assert [c.kind for c in armed.due({2: 29, 3: 28})] == ["crash"]     # rank 2 completed 30 steps
    assert armed.due({2: 29, 3: 29}) == [] and len(armed) == 1
    assert [c.kind for c in armed.due({2: 40})] == ["nan"]              # armed late: at the next report
    assert len(armed) == 0 and armed.due({2: 41}) == []

# -- a controller restart ------------------------------------------------------------------------

def reg(h: Harness, m: str, run: int | None, ranks: list[int] | None = None) -> p.Registration:
    i = h.st.slots.index(m) if m in h.st.slots else 0
    ranks = ranks if ranks is not None else list(range(i * 2, i * 2 + 2))
    return p.Registration(address="127.0.0.1", gpus=2, running_run=run, ranks={r: 1000 + r for r in ranks},
                          warm=2)


def resumed(h: Harness) -> Harness:
    """The same state, loaded by a new controller (a new core, as after a restart)."""
    from stalwart.controller.job import state as S
    from stalwart.controller.job.core import JobCore
    from stalwart.controller.job.events import Resumed
    h.st = S.loads(S.dumps(h.st))
    h.core = JobCore(h.spec, h.cluster)
    acts = h.event(Resumed(down_at=h.now - 5.0, up_at=h.now))
    assert records(acts, "control_plane_down") == [{"down_at": h.now - 5.0, "up_at": h.now}]
    return h


def test_a_run_that_kept_training_is_adopted_after_a_restart():
    from stalwart.controller.job.events import AgentBack
    h = started(Harness(policy={"hang_timeout_floor_s": 2.0}))
    h.steps(10)
    resumed(h)
    assert h.advance(1.0) == []                        # waiting for the agents: no verdicts
    h.event(AgentBack(machine="m0", reg=reg(h, "m0", 1)))
    h.event(AgentBack(machine="m2", reg=reg(h, "m2", None, [])))
    acts = h.event(AgentBack(machine="m1", reg=reg(h, "m1", 1)))
    assert kinds(acts) == ["Record:control_plane_reconciled", "Record:run_adopted"]
    assert h.st.phase == JobPhase.RUNNING and h.st.run_seq == 1
    acts = h.steps(3)                                  # buffered steps keep committing
    assert len(records(acts, "step")) == 3 and not of(acts, a.OpenIncident)


def test_a_run_that_finished_while_the_controller_was_away_is_adopted():
    from stalwart.controller.job.events import AgentBack
    h = started(Harness())
    h.steps(10)
    resumed(h)
    for m in ("m0", "m1"):           # no live rank, each of them finished cleanly
        i = h.st.slots.index(m)
        done = p.Registration(address="127.0.0.1", gpus=2, running_run=1, ranks={},
                              done_ranks=[i * 2, i * 2 + 1])
        acts = h.event(AgentBack(machine=m, reg=done))
    acts += h.event(AgentBack(machine="m2", reg=reg(h, "m2", None, [])))
    assert records(acts, "run_adopted") and not of(acts, a.OpenIncident)


def test_a_run_cut_short_at_its_start_is_restarted_through_a_control_plane_incident():
    from stalwart.controller.job.events import AgentBack
    h = started(Harness())
    resumed(h)
    for m in ("m0", "m1", "m2"):
        acts = h.event(AgentBack(machine=m, reg=reg(h, m, 1 if m != "m2" else None)))
    inc = of(acts, a.OpenIncident)[0]
    assert (inc.symptom, inc.category) == ("control_plane", "control_plane")
    acts = h.stopped()
    assert not of(acts, a.RunChecks)                  # the cause is known: no checks
    run = of(acts, a.StartRun)[0]
    assert run.run == 2 and run.slots == ["m0", "m1"]
    upd = [x.fields for x in of(acts, a.UpdateIncident) if "mechanism" in x.fields][0]
    assert upd["mechanism"] == "reattempt" and "before run 1 completed a step" in upd["cause"]


def test_recovery_cut_short_is_finished_and_a_silent_machine_is_lost():
    from stalwart.controller.job.events import AgentBack
    h = started(Harness())
    h.steps(5)
    h.ckpt(4)
    crash(h)                                           # stop sent; then the controller died
    assert h.st.phase == JobPhase.RECOVERING
    resumed(h)
    h.event(AgentBack(machine="m0", reg=reg(h, "m0", None, [])))
    h.cluster.dead.add("m1")
    acts = h.advance(h.core.reconcile.grace_s() + 0.5)  # m1 never comes back
    assert records(acts, "control_plane_reconciled")
    assert of(acts, a.StopWorkers)[0].machines == ["m0"]     # the stop is sent again (m1 is lost)
    acts += h.stopped(["m0"]) + h.advance(2.0)
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m1", "evicted"), ("m2", "active")]
    assert of(acts, a.StartRun)[0].restore_step == 4


def test_stops_delivered_while_reconciling_wait_for_the_standby_to_come_back():
    """An agent's outbox delivers the old controller's stops first; the standby re-registers a
    moment later. Nothing is decided before every machine is back (the standby is not missing)."""
    from stalwart.controller.job.events import AgentBack
    h = started(Harness())
    h.steps(5)
    h.ckpt(4)
    h.agent("m1", p.Health(probe="gpu", kind="gpu_xid", severity="fatal", machine_certain=True,
                           t=h.now))                  # a machine-certain fault on m1
    assert h.st.phase == JobPhase.RECOVERING
    resumed(h)
    h.cluster.dead.add("m2")                           # the standby has not re-registered yet
    acts = h.stopped()                                 # both stops arrive from the outboxes
    assert not of(acts, a.FinishJob) and not of(acts, a.StartRun)
    for m in ("m0", "m1"):
        acts += h.event(AgentBack(machine=m, reg=reg(h, m, None, [])))
    assert not of(acts, a.FinishJob)
    h.cluster.dead.discard("m2")
    acts = h.event(AgentBack(machine="m2", reg=reg(h, "m2", None, [])))
    assert records(acts, "control_plane_reconciled")
    assert [(x.machine, x.state) for x in of(acts, a.AssignMachine)] == [("m1", "evicted"), ("m2", "active")]
    assert of(acts, a.StartRun)[0].restore_step == 4


def test_checks_cut_short_are_run_again_after_a_restart():
    from stalwart.controller.job.events import AgentBack
    h = started(Harness())
    h.steps(3)
    crash(h)
    first = of(h.stopped(), a.RunChecks)[0]
    resumed(h)
    for m in ("m0", "m1", "m2"):
        acts = h.event(AgentBack(machine=m, reg=reg(h, m, None, [])))
    again = of(acts, a.RunChecks)[0]
    assert again.name != first.name and again.machines == first.machines
    assert h.diag(first) == []                         # the old checks' answers are stale
    acts = h.diag(again)
    assert of(acts, a.StartRun)


def test_silence_during_a_stop_is_judged_against_the_other_machines_not_the_clock():
    h = started(Harness(policy={"heartbeat_s": 0.5}))
    h.steps(3)
    crash(h)
    # the controller was too busy to read anyone for 3 s: every machine looks old, none is lost
    h.cluster.heard = {"m0": h.now - 3.0, "m1": h.now - 3.0}
    assert not of(h.tick(0.1), a.RunChecks) and h.st.incident.lost == set()
    # m1 really fell silent while m0 goes on
    h.cluster.heard = {"m0": h.now, "m1": h.now - 3.0}
    h.tick(0.1)
    assert h.st.incident.lost == {"m1"}
    h.stopped(["m0"])
    assert ("m1", "evicted") in [(x.machine, x.state) for x in of(h.log, a.AssignMachine)]


def test_a_short_pool_with_nothing_free_asks_the_backend_at_most_every_few_seconds():
    h = started(Harness())
    h.steps(3)
    h.ckpt(2)
    h.cluster.dead.add("m1")
    h.event(MachineLost(machine="m1"))
    h.stopped(["m0"])                        # m2 takes m1's slot: the pool (1) is empty, nothing free
    h.step()
    h.advance(5.0)
    asked = of(h.advance(10.0), a.RequestMachines)
    assert [x.count for x in asked] == [1, 1]        # every 5 s at most: the controller counts those coming
    h.cluster.machines.append("m3")                        # a new machine registers
    acts = h.advance(2.0)
    assert ("m3", "standby") in [(x.machine, x.state) for x in of(acts, a.AssignMachine)]
    assert not of(h.advance(10.0), a.RequestMachines)


def test_a_jump_a_restart_reproduces_at_the_same_step_is_the_trainings_own():
    h = started(Harness(spare=1))
    h.steps(6)
    for s in (4, 5):
        h.ckpt(s)
    spike = h.st.steps_done
    acts = h.step(loss=50.0)                       # a 25x loss jump: an incident
    assert of(acts, a.OpenIncident)[0].symptom == "loss_spike"
    run = of(h.stopped() + h.advance(2.0), a.StartRun)[0]
    assert run.restore_step < spike
    while h.st.steps_done < spike:
        assert not of(h.step(), a.OpenIncident)
    acts = h.step(loss=50.0)                       # the same jump at the same step: the data's
    assert not of(acts, a.OpenIncident) and records(acts, "jump_reproduced")[0]["step"] == spike
    assert h.st.phase == JobPhase.RUNNING
    acts = h.step(loss=500.0)                      # a new jump at another step is an incident again
    assert of(acts, a.OpenIncident)[0].symptom == "loss_spike"


def test_a_run_restored_from_further_back_restores_its_own_copies_next_time():
    h = started(Harness(spare=2))
    for s in range(12):
        h.step()
        h.ckpt(s)
    for r in range(h.world):
        h.agent(h.machine_of(r), p.Ckpt(run=h.st.run_seq, rank=r, step=5, tier="durable", location=f"/d/{r}/5"))
    h.step(loss=NAN, local={2: float("inf")})         # step 12 is bad...
    h.ckpt(12)
    h.step()
    h.ckpt(13)                                        # ...and so is 13: memory holds only bad steps
    run = of(h.stopped() + h.advance(2.0), a.StartRun)[0]
    assert run.restore_step == 5                      # the durable copy
    for _ in range(3):                                # the new run trains 6, 7, 8: below the stale 12, 13
        s = h.st.steps_done
        h.step()
        h.ckpt(s)
    crash(h)
    checks = of(h.stopped(), a.RunChecks)[0]
    run = of(h.diag(checks), a.StartRun)[0]
    assert run.restore_step == 8                      # its own copies, not durable step 5 again


def test_several_agents_events_together_decide_as_each_one_alone():
    """AgentEvents (every machine's answer to one command, every rank's report of a step) gives the
    actions and the state of the same events handled one AgentEvent at a time: steps, a crash
    nobody can pin on a machine, the stops, the checks that find the culprit, the restart."""
    def drive(together: bool) -> tuple[list[a.Action], str]:
        h = started(Harness(machines=4, gpus=2, standby=1))
        out: list[a.Action] = []

        def send(items: list[tuple[str, p.Event]]) -> None:
            if together:
                out.extend(h.event(AgentEvents(items=tuple(items))))
            else:
                for m, ev in items:
                    out.extend(h.agent(m, ev))
        for s in range(4):
            h.now += 1.0
            send([(h.machine_of(r), p.Step(run=1, rank=r, step=s, t=h.now, dur=1.0, loss=2.0, grad_norm=1.0))
                  for r in range(h.world)])
        send([(h.machine_of(r), p.Ckpt(run=1, rank=r, step=3, tier="durable", location="d/3")) for r in range(h.world)])
        h.now += 1.0
        send([("m1", p.WorkerExit(run=1, rank=2, code=1, log_tail=(
            "RuntimeError: CUDA error: an illegal memory access was encountered")))])
        send([(m, p.Stopped(run=1, inventory={"own": {2 * i: [3], 2 * i + 1: [3]}}))
              for i, m in enumerate(h.st.slots)])
        out.extend(h.tick(2.0))
        checks = of(out, a.RunChecks)[-1]
        answers: list[tuple[str, p.Event]] = [(m, p.DiagResult(id=checks.name, results=[
            {"check": "selftest", "ok": m != "m1", "detail": "ok" if m != "m1" else "failed",
             "measure": {"gflops": 10.0}}, {"check": "intra", "ok": True, "detail": "ok", "measure": {}}]
            + [{"check": "inter", "ok": True, "detail": "ok", "round": x.round, "peer": x.peer,
                "measure": {"mbps": 100.0}} for x in checks.inter_of(m)])) for m in checks.machines]
        # among them: another check's result, a machine answering twice, answers after the last
        # one awaited (the checks are over: they change nothing), a durable copy in between
        stray = (answers[0][0], p.DiagResult(id="another", results=[{"check": "selftest", "ok": False}]))
        ckpt = (answers[1][0], p.Ckpt(run=1, rank=0, step=3, tier="durable", location="d/3"))
        send([stray, answers[0], answers[0], ckpt] + answers[1:] + [answers[2], stray])
        return out, S.dumps(h.st)
    one, st_one = drive(False)
    together, st_together = drive(True)
    assert repr(together) == repr(one) and st_together == st_one
    evicted = [x.machine for x in of(one, a.AssignMachine) if x.state == "evicted"]
    assert evicted == ["m1"] and [x.restore_step for x in of(one, a.StartRun)] == [3] and records(one, "step")


def test_one_report_of_a_step_for_all_ranks_decides_as_each_rank_alone():
    """StepReport (one step of many ranks as columns) gives the actions and the state, hang watch
    included, of the same reports handled one rank at a time: whole steps with compute times,
    a step some ranks reported before the rest, a report listing a rank twice, a report of a
    committed step and one of another run, then a crash and the restart. The same with every
    whole-job report's ranks a `range` (as the simulator sends them)."""
    def drive(together: bool, as_range: bool = False) -> tuple[list[a.Action], str]:
        h = started(Harness(machines=4, gpus=2, standby=1))
        out: list[a.Action] = []

        def send(s: int, ranks: list[int], run: int = 1, loss: float | None = 2.0) -> None:
            comp = tuple(0.5 + 0.01 * r for r in ranks)
            listed = range(h.world) if as_range and ranks == list(range(h.world)) else tuple(ranks)
            rep = StepReport(run=run, step=s, t=h.now, dur=1.0, machines=tuple(h.machine_of(r) for r in ranks),
                             ranks=listed, compute_s=comp, loss=loss, grad_norm=1.0, local_grad_norm=0.5)
            if together:
                out.extend(h.event(rep))
            else:
                for m, ev in rep.as_agent_events().items:
                    out.extend(h.agent(m, ev))
        for s in range(6):
            h.now += 1.0
            send(s, list(range(h.world)))
        h.now += 1.0
        send(6, [5, 6], loss=None)                 # part of a step, then the rest and more
        send(6, [7, 0, 1, 2, 3, 4, 5])
        h.now += 1.0
        send(7, [1, 1, 2, 0, 3, 4, 5, 6, 7])       # a rank twice
        send(7, list(range(h.world)))             # committed already
        send(8, list(range(h.world)), run=2)      # another run's
        h.now += 1.0
        send(8, list(reversed(range(h.world))))
        out.extend(h.tick(400.0))                 # long silence: the hang watch decides
        return out, S.dumps(h.st)
    one, st_one = drive(False)
    together, st_together = drive(True)
    ranged, st_ranged = drive(True, as_range=True)
    assert repr(together) == repr(one) == repr(ranged) and st_together == st_one == st_ranged
    assert [x["step"] for x in records(one, "step")] == list(range(9))
    assert of(one, a.TraceStacks)                 # the hang was seen, from the same per-rank times


def test_one_report_of_a_stop_for_all_machines_decides_as_each_machine_alone():
    """StopReport (every machine's answer to a stop, inventories as columns) gives the actions and
    the state, restore availability included, of the same `Stopped` events handled one machine at a
    time: copies reported while running, a stop answered in two parts (a machine with an empty
    inventory among them) whose last answer localizes the crash, and the restart from memory."""
    def drive(together: bool) -> tuple[list[a.Action], str]:
        h = started(Harness(machines=4, gpus=2, standby=1))
        out: list[a.Action] = []
        for _ in range(5):
            out += h.step()
        h.ckpt(1)
        h.ckpt(2)
        h.now += 1.0
        out += h.agent("m1", p.WorkerExit(run=1, rank=2, code=1, log_tail="RuntimeError: CUDA error: "
                                          "unspecified launch failure"))
        slots = list(h.st.slots)

        def send(machines: list[str], empty: set[str] = frozenset()) -> None:
            idx = [slots.index(m) for m in machines]
            rep = StopReport(run=1, t=h.now, machines=tuple(machines),
                             own_ranks=tuple(None if m in empty else (2 * i, 2 * i + 1) for m, i in zip(machines, idx)),
                             backup_ranks=tuple(() if m in empty else (2 * ((i + 1) % 4), 2 * ((i + 1) % 4) + 1)
                                                for m, i in zip(machines, idx)),
                             own=(3, 4), backup=(4,))
            if together:
                out.extend(h.event(rep))
            else:
                for m, ev in rep.as_agent_events().items:
                    out.extend(h.agent(m, ev))
        send(slots[2:], empty={slots[3]})
        out.extend(h.tick(0.5))
        send(slots[:2])
        out.extend(h.tick(2.0))
        return out, S.dumps(h.st)
    one, st_one = drive(False)
    together, st_together = drive(True)
    assert repr(together) == repr(one) and st_together == st_one
    assert [x.restore_step for x in of(one, a.StartRun)][-1] == 4        # from the stop's inventories
