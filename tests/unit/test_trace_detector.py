"""The trace detector: the one-class model on synthetic collective traces (a shifted duration, a
missing collective, a reordered sequence and a slow rank are flagged; a job that slows alike on
every rank is not), the flight-recorder hook's trace, and the detector in the job core (an alert
names the machine; it evicts only when the policy allows and the job is slowed)."""
from __future__ import annotations

import importlib.util
import os

import pytest
from corekit import Harness, of, records

import stalwart
from stalwart import protocol as p
from stalwart.analyzer.traces import DensityModel, window_features
from stalwart.controller.job import actions as a
from stalwart.controller.job.state import JobPhase, dumps, loads
from stalwart.sim.traces import Fault, synth, to_windows

RANKS = 8
PEERS = [list(range(RANKS))]


@pytest.fixture(scope="module")
def model() -> DensityModel:
    healthy = to_windows(synth(RANKS, 400, seed=1), 0.5)[1:-1]
    return DensityModel.fit_rows(row for w in healthy for row in window_features(w, PEERS).values())


def flagged(model: DensityModel, fault: Fault | None, seed: int = 2, steps: int = 200) -> dict[int, int]:
    """Per rank, the longest run of abnormal windows in a row."""
    best: dict[int, int] = {}
    run: dict[int, int] = {}
    for w in to_windows(synth(RANKS, steps, seed=seed, fault=fault), 0.5)[1:-1]:
        for r, row in window_features(w, PEERS).items():
            run[r] = run.get(r, 0) + 1 if model.score(row)[1] else 0
            best[r] = max(best.get(r, 0), run[r])
    return {r: n for r, n in best.items() if n}


@pytest.mark.parametrize("kind", ["slow-op", "missing", "reordered", "slow-compute"])
def test_a_partial_fault_on_one_rank_is_flagged_on_that_rank_only(model, kind):
    found = flagged(model, Fault(kind, rank=5, factor=2.0, op=1))
    assert found.get(5, 0) >= 3, found
    assert all(n < 2 for r, n in found.items() if r != 5), found


def test_the_flagged_features_name_the_abnormal_collective(model):
    w = to_windows(synth(RANKS, 100, seed=3, fault=Fault("missing", rank=2, op=3)), 0.5)[2]
    _, worst = model.score(window_features(w, PEERS)[2])
    assert "n:gloo:broadcast@tp" in worst


@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_a_uniformly_slower_job_is_not_flagged(model, factor):
    found = flagged(model, Fault("uniform", factor=factor))
    assert all(n < 2 for n in found.values()), found       # the detector needs 2 windows in a row


def test_healthy_runs_of_other_seeds_are_not_flagged(model):
    for seed in (4, 5, 6):
        found = flagged(model, None, seed=seed)
        assert all(n < 2 for n in found.values()), (seed, found)


def test_a_rank_alone_in_its_peer_group_or_with_few_collectives_gets_no_features():
    w = to_windows(synth(2, 50, seed=1), 0.5)[1]
    assert window_features(w, [[0], [1]]) == {}
    few = to_windows(synth(4, 1, seed=1), 10.0)[0]             # one step: 6 collectives a rank
    assert window_features(few, [[0, 1, 2, 3]]) == {}


# -- the flight-recorder hook's trace ------------------------------------------------------------
def _frhook():
    path = os.path.join(os.path.dirname(stalwart.__file__), "worker", "frhook.py")
    spec = importlib.util.spec_from_file_location("_frhook_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_hook_traces_new_collectives_with_gaps_and_bytes_once():
    hook = _frhook()
    tr = hook.Tracer(limit=2)
    e = [{"record_id": i, "profiling_name": "gloo:all_reduce", "process_group": ["7", "dp"],
          "time_created_ns": 1_000_000_000 + i * 5_000_000, "input_sizes": [[10, 4]], "input_dtypes": ["Float"]}
         for i in range(3)]
    ops = tr.ops(e)
    assert [o[-1] for o in ops] == [1, 2]                     # the newest `limit`
    assert ops[-1] == ["gloo:all_reduce", "7", "dp", None, 160, 5.0, 2]
    assert tr.ops(e) == []                                    # nothing new
    more = e + [dict(e[0], record_id=3, time_created_ns=1_000_000_000 + 25_000_000)]
    [op] = tr.ops(more)
    assert op[5] == 15.0 and p.TraceOp(*op).seq == 3


# -- in the job core --------------------------------------------------------------------------
POLICY = {"trace_train_s": 5.0, "trace_window_s": 1.0, "failslow_drop": 0.3}


def started(**policy) -> Harness:
    h = Harness(machines=4, gpus=1, standby=1, steps=10_000, policy=dict(POLICY, **policy))
    h.tick()
    assert h.st.phase == JobPhase.RUNNING
    return h


def feed(h: Harness, seconds: float, fault: Fault | None = None, seed: int = 0, step_s: float = 1.0) -> list:
    """`seconds` of synthetic traces and steps; each second one activity event per machine."""
    ops = synth(h.world, int(seconds / 0.012) + 1, seed=seed, fault=fault, durations=False, t0=h.now)
    out: list = []
    end, i = h.now + seconds, 0
    while h.now < end:
        upto = h.now + 1.0
        by_rank: dict[int, list[p.TraceOp]] = {}
        while i < len(ops) and ops[i][0] < upto:
            by_rank.setdefault(ops[i][1], []).append(ops[i][2])
            i += 1
        for m in list(h.st.slots):
            mine = {r: v for r, v in by_rank.items() if h.machine_of(r) == m}
            out += h.agent(m, p.Activity(run=h.st.run_seq, traces=mine, t=h.now))
        n = int(1.0 / step_s)
        out += h.steps(n, dur=step_s) if n else h.tick(1.0)     # (a step longer than a second: none ends)
    return out


def test_the_core_learns_then_names_a_slow_machine_without_evicting():
    h = started()
    acts = feed(h, 9)
    [fit] = records(acts, "trace_model_fitted")
    assert fit["windows"] >= 3 and not records(acts, "trace_suspect")
    saved = dumps(h.st)
    assert dumps(loads(saved)) == saved and h.st.signals.traces.model is not None
    acts = feed(h, 6, fault=Fault("slow-compute", rank=2, factor=2.5), seed=1)
    alerts = records(acts, "trace_suspect")
    assert alerts and alerts[0]["machines"] == ["m2"] and alerts[0]["ranks"] == [2]
    assert alerts[0]["collectives"]
    assert not of(acts, a.OpenIncident)              # trace_evict is off: an alert, no eviction
    assert h.st.phase == JobPhase.RUNNING


def test_an_alert_evicts_only_when_allowed_and_the_job_is_slowed():
    h = started(trace_evict=True)
    feed(h, 9, step_s=0.5)
    acts = feed(h, 4, fault=Fault("slow-compute", rank=2, factor=2.5), seed=1, step_s=0.5)
    assert records(acts, "trace_suspect") and not of(acts, a.OpenIncident)      # not slowed: no eviction
    acts = feed(h, 6, fault=Fault("slow-compute", rank=2, factor=2.5), seed=2, step_s=1.0)
    [inc] = of(acts, a.OpenIncident)
    assert inc.symptom == "trace_outlier"
    assert h.st.incident.implicit_evict == ["m2"] and "slower than its healthy pace" in h.st.incident.reason


def test_the_model_outlives_a_restart_and_the_switch_turns_it_off():
    h = started()
    feed(h, 9)
    model = h.st.signals.traces.model
    h.core.implicit.new_run(h.st, h.now)
    assert h.st.signals.traces.model is model
    off = started(trace_detector=False)
    assert off.st.signals.traces is None
    feed(off, 3)


def test_the_agent_forwards_each_trace_operation_once(tmp_path):
    from stalwart.agent.progress import ProgressWatch
    pw = ProgressWatch(str(tmp_path), workers=list, has_sdk=lambda pid: True, last_steps=dict, run=lambda: 1,
                       emit=lambda ev: None)
    op = ["gloo:all_reduce", "7", "dp", None, 160, 5.0]
    summary = {"pid": 42, "trace": [op + [1], op + [2], ["bad"]]}
    assert [o.seq for o in pw._new_ops(0, summary)] == [1, 2]
    assert pw._new_ops(0, summary) == []                      # the same summary read again
    assert [o.seq for o in pw._new_ops(0, {"pid": 42, "trace": [op + [2], op + [3]]})] == [3]
    assert [o.seq for o in pw._new_ops(0, {"pid": 43, "trace": [op + [1]]})] == [1]   # a new process
    ev = p.decode_event(p.encode(p.Activity(run=1, traces={0: pw._new_ops(1, summary)}, t=1.0)))
    assert isinstance(ev, p.Activity) and ev.traces[0][1] == p.TraceOp("gloo:all_reduce", "7", "dp", None, 160, 5.0, 2)


# -- stalls: a rank stuck before the collective its peers wait in ------------------------------
def _stall_window(fault: Fault) -> tuple[dict, dict[int, int]]:
    """The empty window after a stall, and each rank's newest collective id."""
    last: dict[int, int] = {}
    for _, r, op in synth(RANKS, 20, seed=1, fault=fault):
        last[r] = op.seq
    return {}, last


def test_a_stuck_rank_is_named_in_a_stall_unless_it_computes_or_most_are_behind():
    from stalwart.analyzer.traces import stall_laggards
    empty, last = _stall_window(Fault("stuck", rank=3, at=12, op=2))
    assert stall_laggards(empty, last, [], PEERS) == {3: 1}
    assert stall_laggards(empty, last, [3], PEERS) == {}           # it computes: an evaluation, not a hang
    assert stall_laggards(empty, last, [], [[0, 1], [2, 3, 4, 5, 6, 7]]) == {3: 1}
    behind = {r: (9 if r < 5 else 10) for r in range(RANKS)}        # five of eight behind: no culprit
    assert stall_laggards(empty, behind, [], PEERS) == {}
    busy = to_windows(synth(RANKS, 20, seed=1), 10.0)[0]             # the group entered collectives
    assert stall_laggards(busy, last, [], PEERS) == {}
    same = {r: "gloo:all_reduce@dp" for r in range(RANKS)}             # behind by a constant, waiting
    assert stall_laggards(empty, last, [], PEERS, same) == {}          # in the same collective
    other = {**same, 3: "gloo:broadcast@tp"}
    assert stall_laggards(empty, last, [], PEERS, other) == {3: 1}
    _, healthy = _stall_window(None)                                   # the run's end: everyone level
    assert stall_laggards(empty, healthy, [], PEERS) == {}


def stall(h: Harness, seconds: float, fault: Fault, active: tuple[int, ...] = ()) -> list:
    """Traces up to a stall (`fault` of kind stuck), then `seconds` with no collective and no step;
    each second one activity event per machine (`active`: ranks that still compute)."""
    ops = synth(h.world, fault.at + 1, seed=3, fault=fault, durations=False, t0=h.now)
    out: list = []
    for m in list(h.st.slots):
        mine = {r: [op for _, rr, op in ops if rr == r] for r in range(h.world) if h.machine_of(r) == m}
        out += h.agent(m, p.Activity(run=h.st.run_seq, traces=mine, t=h.now))
    end = h.now + seconds
    while h.now < end:
        out += h.advance(1.0)
        for m in list(h.st.slots):
            mine_active = sorted(r for r in active if h.machine_of(r) == m)
            out += h.agent(m, p.Activity(run=h.st.run_seq, ranks=mine_active, t=h.now))
    return out


def test_the_core_names_a_stuck_machine_in_a_stall_and_leaves_it_to_the_hang_detector():
    h = started(trace_evict=True, hang_timeout_floor_s=60.0)
    feed(h, 9)
    acts = stall(h, 4, Fault("stuck", rank=1, at=40, op=3))
    [alert] = records(acts, "trace_suspect")
    assert alert["machines"] == ["m1"] and alert["ranks"] == [1] and alert["stall"]
    assert "gloo:broadcast@tp never entered" in alert["collectives"][0], alert
    assert not of(acts, a.OpenIncident)              # a stall's alert never evicts


def test_a_rank_computing_through_a_stall_is_not_named():
    h = started(hang_timeout_floor_s=60.0)
    feed(h, 9)
    acts = stall(h, 4, Fault("stuck", rank=1, at=40, op=3), active=(1,))
    assert not records(acts, "trace_suspect")


def test_a_step_under_way_for_many_healthy_steps_counts_as_slowed():
    # a link that makes a step 90x slower finishes the three slow steps a median needs minutes late:
    # the step under way, already as long as many healthy ones, says the job is slowed
    h = started(trace_evict=True)
    feed(h, 9, step_s=0.5)
    acts = feed(h, 6, fault=Fault("slow-compute", rank=2, factor=2.5), seed=1, step_s=10.0)
    [inc] = of(acts, a.OpenIncident)
    assert inc.symptom == "trace_outlier"
    assert h.st.incident.implicit_evict == ["m2"] and "slower than its healthy pace" in h.st.incident.reason
