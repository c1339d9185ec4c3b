"""The cluster simulator (`stalwart sim`) and the what-if analysis (`stalwart whatif`)."""
from __future__ import annotations

import copy
import json
import math

import pytest
from corekit import Harness, of
from stalwart import cli
from stalwart.controller.job import actions as a
from stalwart.controller.job import state as S
from stalwart.controller.job.core import JobCore
from stalwart.controller.cluster.standby import p99_standbys
from stalwart.controller.rules.restore import Availability
from stalwart.sim import peers, results
from stalwart.sim.engine import DAY, T0, Config, Sim
from stalwart.sim.failures import Fault, Model, trace
from stalwart.sim.profile import load
from stalwart.sim.whatif import analyze
from stalwart.topology import Topology

H = 3600.0


def scenario() -> list[Fault]:
    """A crash, a lost machine, a hang, a NaN from a corrupting machine (alignment check, replay),
    an ambiguous persistent CUDA error (reattempt, then checks or replay), a hot update."""
    return [Fault(2 * H, "cpu_overload", "crash", 1, False, seed=11),
            Fault(5 * H, "container", "lost", 2, True, seed=12),
            Fault(8 * H, "hang", "hang", 3, True, seed=13),
            Fault(11 * H, "nan", "nan", 4, True, ambiguous=True, seed=14),
            Fault(15 * H, "cuda_error", "gpu", 5, True, ambiguous=True, seed=15),
            Fault(19 * H, "update", "update", 0, False, urgent=True, seed=16)]


def small(days: float = 1.0, gpus: int = 128, standby: str = "auto") -> Config:
    return Config(gpus=gpus, pp=4, days=days, standby=standby)


def recorded_sim(faults: list[Fault], policy: str = "stalwart", model: Model | None = None,
                 cfg: Config | None = None) -> tuple[Sim, list]:
    """Run the simulator, recording every event its job core handled with the time, the cluster the
    core saw then, and the actions it returned."""
    sim = Sim(cfg or small(), peers.POLICIES[policy], load("paper"), model or Model(), faults, seed=3)
    log: list = []
    handle = JobCore.handle

    def spy(core, st, ev, now):
        if core is not getattr(sim, "core", None):       # (only this simulation's core is recorded)
            return handle(core, st, ev, now)
        c = sim.cluster
        seen = (set(c.order) - c.out, set(c.dead_at), set(c.busy), {m: c.labels(m) for m in c.order})
        before = copy.deepcopy(ev)          # the core keeps (and updates) a registered version's row
        acts = handle(core, st, ev, now)
        log.append((sim.seg.index if sim.seg else 0, now, before, seen, acts))
        return acts
    JobCore.handle = spy           # type: ignore[method-assign]
    try:
        sim.run()
    finally:
        JobCore.handle = handle    # type: ignore[method-assign]
    return sim, log


def test_the_simulator_and_the_controller_s_core_take_the_same_decisions():
    """The events the simulator's agents produced (a crash, a lost machine, a hang, a NaN, a replay,
    a hot update), fed in the same order at the same times to a job core set up the way the
    controller sets one up (corekit's harness: the controller's cluster view, its job state, every
    state saved and reloaded), give exactly the actions the simulator carried out."""
    sim, log = recorded_sim(scenario())
    acts = [x for *_, got in log for x in got]
    symptoms = {i["symptom"] for i in sim.incidents}
    assert {"worker_crash", "machine_lost", "hang", "nan", "illegal_memory_access", "hot_update"} <= symptoms, symptoms
    assert of(acts, a.StartReplayGroup), "the scenario must replay"
    assert of(acts, a.RunChecks) and of(acts, a.TraceStacks) and of(acts, a.Prewarm)
    assert [x for x in of(acts, a.AssignMachine) if x.state == "evicted"]
    replay_in_core(sim, log)


def replay_in_core(sim: Sim, log: list) -> None:
    """Feed the recorded events to a core set up as the controller sets one up; assert the same actions."""
    segments = {seg for seg, *_ in log}
    for seg in sorted(segments):
        h = Harness(machines=2)                  # replaced by the simulated job's spec and cluster below
        h.spec, h.core = sim.spec, JobCore(sim.spec, h.cluster)
        start = next(t for s, t, *_ in log if s == seg)
        h.st = S.JobState(job_id=seg, created_at=start,
                          avail=Availability(memory={"own": max(2, sim.spec.policy.mem_slots - 1), "backup": 2}))
        h.st.versions = [dict(sim.version_row(1, "stable", "lazy"), created_at=start, applied_at=start)]
        h.st.version_id, h.st.code_path = 1, "/sim/code/v1"
        for s, t, ev, (machines, dead, busy, labels), got in log:
            if s != seg:
                continue
            c = h.cluster
            c.machines = [m for m in sim.cluster.order if m in machines]
            c.dead, c.busy, c.tags = dead, busy, labels
            c.heard = {m: sim.cluster.dead_at[m] for m in dead}
            h.now = t
            assert repr(h.event(ev)) == repr(got), (t, ev)


def test_the_simulator_s_executor_refuses_an_action_it_does_not_know():
    sim = Sim(small(), peers.STALWART, load("paper"), Model(), [], seed=1)
    sim.submit(0)
    with pytest.raises(TypeError, match="cannot perform"):
        sim.perform([a.SendChaos(machine="m0", kind="crash", rank=0, step=1)])
    sim.perform([a.RequestMachines(count=2)])       # the scheduler is asked: two machines come
    assert sim.coming == 2


def test_standby_auto_is_the_p99_of_a_binomial():
    """Table 5's P99 standby counts (0.12% per machine per day), and an independent computation."""
    assert [p99_standbys(n, 0.0012) for n in (128, 256, 512, 1024)] == [2, 2, 3, 4]
    for n, rate in ((1200, 0.0012), (64, 0.05), (500, 0.01)):
        cdf, k = 0.0, -1
        while cdf < 0.99:
            k += 1
            cdf += math.comb(n, k) * rate ** k * (1 - rate) ** (n - k)
        assert p99_standbys(n, rate) == k
    with pytest.raises(ValueError):
        p99_standbys(0, 0.01)


def test_standby_auto_sizes_the_pool_in_the_simulator_and_in_a_core_job():
    # the simulator: 1,200 machines keep P99(Binomial(1200, 0.12%)) = 5 warm standbys; the core may
    # count on a pipeline group (8), the 3 beyond the warm pool being rescheduled when taken
    sim = Sim(Config(days=0.01), peers.STALWART, load("paper"), Model(), [], seed=1)
    assert sim.warm_standbys == p99_standbys(1200, 0.0012) == 5 and sim.standbys == 8
    sim.run()
    assert len(sim.st.pool.standby) == 8 and len(sim.cluster.free()) == 0
    bare = Sim(Config(days=0.01), peers.POLICIES["stalwart-no-standby"], load("paper"), Model(), [], seed=1)
    assert bare.standbys == 0
    # a job of the controller's core (corekit): 64 machines at 5% per day
    h = Harness(machines=64, gpus=1, standby="auto", spare=20, policy={"daily_failure_rate": 0.05})
    want = p99_standbys(64, 0.05)
    h.tick()
    h.steps(1)
    h.tick(1.5)
    pool = [x for x in h.log if isinstance(x, a.AssignMachine) and x.state == "standby"]
    assert len(pool) == len(h.st.pool.standby) == want == 8


def test_a_short_run_is_deterministic_and_its_buckets_sum_to_the_wall_time():
    model = Model(daily_rate=0.02)          # 64 machines x 3 days: a few incidents of each stream
    faults = trace(model, 64, 3, seed=5)
    assert faults == trace(model, 64, 3, seed=5) and faults != trace(model, 64, 3, seed=6)
    out = []
    for _ in range(2):
        cfg = Config(gpus=512, pp=4, days=3)
        sim = Sim(cfg, peers.STALWART, load("paper"), model, faults, seed=5).run()
        r = results.summarize(sim, 0.0)
        assert r["incidents"] >= 3
        total = r["productive_s"] + sum(r["unproductive_s"].values())
        assert total == pytest.approx(3 * DAY, rel=1e-6)
        assert 0.5 < r["ettr"] < 1.0
        out.append({k: v for k, v in r.items() if k not in ("runtime_s",)})
    assert json.dumps(out[0], sort_keys=True) == json.dumps(out[1], sort_keys=True)


def test_every_policy_runs_the_same_trace():
    faults = scenario()
    rs = [results.summarize(Sim(small(), plat, load("measured"), Model(), faults, seed=3).run(), 0.0)
          for plat in peers.parse("all")]
    agg = results.aggregate(rs)
    assert set(agg) == set(peers.POLICIES)
    assert all(0.0 < r["ettr"] <= 1.0 for r in agg.values())
    assert agg["stalwart"]["ettr"] > agg["requeue"]["ettr"]
    assert "stalwart" in results.table(agg) and "<svg" in results.svg(rs, "t")


def test_the_default_pipeline_is_the_largest_up_to_8_stages_that_divides_the_machines(capsys):
    from stalwart.sim.command import default_pp
    assert [default_pp(m) for m in (1200, 12500, 12, 7, 3)] == [8, 5, 6, 1, 1]
    assert cli.main(["sim", "--gpus", "40", "--days", "0.05", "--policies", "stalwart", "--quiet",
                     "--jobs", "1"]) == 0
    err = capsys.readouterr().err
    assert "note: 5 machines: pipelines of 1 stage (8 does not divide them; --pp N to choose)" in err


@pytest.mark.parametrize("args, msg", [
    (["--gpus", "100"], "multiple of --gpus-per-machine"),
    (["--gpus", "64", "--pp", "8"], "cannot hold pipelines"),
    (["--policies", "stalwart,bogus"], "unknown policy bogus"),
    (["--profile", "nope"], "no profile 'nope'"),
    (["--set", "daily_rate"], "KEY=VALUE"),
    (["--set", "nonsense=1"], "unknown failure-model key"),
    (["--set", "daily_rate=abc"], "not a number"),
    (["--days", "-1"], "--days must be > 0"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--standby", "many"], "--standby must be"),
    (["--json", "/nonexistent/dir/x.json"], "no such directory"),
])
def test_sim_bad_input_is_one_line(capsys, args, msg):
    assert cli.main(["sim", "--gpus", "128", "--pp", "4", "--days", "0.1", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and err.count("\n") == 1, err


def test_sim_command_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    js, svg = tmp_path / "r.json", tmp_path / "r.svg"
    assert cli.main(["sim", "--gpus", "128", "--pp", "4", "--days", "0.5", "--seeds", "2", "--quiet", "--jobs", "1",
                     "--policies", "requeue,stalwart", "--json", str(js), "--plot", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "requeue" in out and "stalwart" in out and "runtime" in out
    doc = json.loads(js.read_text())
    assert doc["gpus"] == 128 and doc["days"] == 0.5 and doc["runtime_s"] >= 0
    for name in ("requeue", "stalwart"):
        p = doc["policies"][name]
        assert p["ettr_min"] <= p["ettr"] <= p["ettr_max"] and isinstance(p["unproductive_s"], dict)
    assert svg.read_text().startswith("<svg")


# -- what-if ----------------------------------------------------------------------------------------

def rank_times(world: int, slow: dict[int, float], steps: int = 5) -> list[dict]:
    return [{"step": 20 * i, "step_s": [1.2] * world,
             "compute_s": [slow.get(r, 1.0) for r in range(world)]} for i in range(steps)]


def test_whatif_replaces_the_slowest_by_the_median():
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=2)     # machine = one stage's TP group
    # rank 5 computes 1.5 s, the others 1.0 s
    res = analyze(rank_times(8, {5: 1.5}), topo, microbatches=4)
    assert res["step_s"] == pytest.approx(1.2)
    stage = topo.coords(5)["pp"]
    # the slow pipeline: stages 1.0 and 1.5 -> (2.5 + 3 * 1.5) / 4 = 1.75; without it (2 + 3) / 4 = 1.25
    assert res["critical_s"] == pytest.approx(1.75)
    for name, slowest in (("rank", 5), ("machine", topo.machine_of(5)), ("stage", stage)):
        s = res["scenarios"][name]
        assert s["slowest"] == slowest and s["step_s"] == pytest.approx(1.2 - 0.5)
        assert s["saving"] == pytest.approx(0.5 / 1.2)
    # nothing slow: nothing to gain
    flat = analyze(rank_times(8, {}), topo)
    assert all(s["saving"] == pytest.approx(0.0) for s in flat["scenarios"].values())
    with pytest.raises(ValueError, match="compute time"):
        analyze([{"step": 0, "step_s": [1.0] * 8, "compute_s": [None] * 8}], topo)


def test_whatif_command_reads_a_job_from_the_store(tmp_path, capsys):
    from stalwart.controller.store.db import Store
    url = f"sqlite:///{tmp_path / 'stalwart.db'}"
    store = Store(url)
    spec = {"name": "w", "machines": 4, "gpus_per_machine": 2, "tp": 2, "pp": 2, "command": ["python", "t.py"]}
    job = store.create_job("w", spec, now=1.0, submitted=True)
    for i, d in enumerate(rank_times(8, {3: 2.0})):
        store.add_event(job, "rank_times", d, t=10.0 + i)
    store.close()
    assert cli.main(["whatif", "--job", str(job), "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "without its slowest rank" in out and "(rank 3:" in out and "faster" in out
    assert cli.main(["whatif", "--job", "99", "--state-dir", str(tmp_path)]) == 2
    assert "no job 99" in capsys.readouterr().err
    assert cli.main(["whatif", "--job", "1", "--state-dir", str(tmp_path / "none")]) == 2
    assert "no stalwart state" in capsys.readouterr().err


def test_sim_whatif_mode_analyzes_the_simulated_rank_times(capsys):
    """The simulated last pipeline stage computes 15% longer (the loss head): it is the slowest."""
    assert cli.main(["sim", "--gpus", "128", "--pp", "4", "--days", "0.15", "--quiet", "--jobs", "1",
                     "--policies", "stalwart", "--whatif"]) == 0
    out = capsys.readouterr().out
    assert "what-if (stalwart, seed 1" in out and "without its slowest stage    (stage 3:" in out, out


def test_a_slow_machine_nobody_acts_on_is_reported_one_step_at_a_time_only_while_it_could_be():
    """nvrx-like lets a slow machine pass: its steps are reported one by one (for the slowdown
    detectors) for a bounded watch, then in stretches, with the same accounting either way."""
    faults = [Fault(2 * H, "mfu_decline", "slow", 1, True, seed=21)]
    sim = Sim(small(days=2.0), peers.POLICIES["nvrx-like"], load("paper"), Model(), faults, seed=3).run()
    assert sim.pace.slow, "nvrx-like does not act on a slowdown"
    pol = sim.spec.policy
    watch = 2 * (pol.similarity_window_s + pol.similarity_continuity_s
                 + pol.failslow_rounds * pol.failslow_period_s) + 600.0
    reports_while_watching = watch / (sim.cfg.step_s * Model().slowdown)
    # a few reports a run outside the watch; one a step while it lasts (~44 hours were slow)
    assert sim.stats["reports"] < reports_while_watching + 50, sim.stats
    r = results.summarize(sim, 0.0)
    assert abs(sum(r["unproductive_s"].values()) + r["productive_s"] - 2 * DAY) < 1.0


def test_a_machine_that_died_under_a_job_ended_before_its_eviction_is_replaced():
    """A machine lost a second before a planned maintenance requeues the job: the job ends before it
    evicts the machine. The scheduler drains and replaces it anyway; without standbys, a job of the
    whole pool would otherwise wait for it forever."""
    faults = [Fault(2 * H, "container", "lost", 2, True, seed=12), Fault(2 * H + 1.0, "planned", "planned", 0, False)]
    sim = Sim(small(days=0.5), peers.POLICIES["stalwart-no-standby"], load("paper"), Model(), faults, seed=3).run()
    assert sim.stats["dead_drained"] == 1
    starts = [e["t"] for seg in sim.segments for e in seg.log if e["kind"] == "run_started"]
    assert len(sim.segments) >= 2 and starts[-1] > T0 + 2 * H, starts          # the requeued job ran again
    assert results.summarize(sim, 0.0)["ettr"] > 0.5
