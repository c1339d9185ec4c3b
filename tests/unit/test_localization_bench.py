"""The fault matrix's scoring (bench/localization.py), on synthetic outcomes."""
import importlib.util
import os
import sys

import pytest

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "localization.py")
spec = importlib.util.spec_from_file_location("localization_bench", PATH)
bench = importlib.util.module_from_spec(spec)
assert spec.loader is not None
sys.modules[spec.name] = bench          # its dataclasses look their module up
spec.loader.exec_module(bench)
Case = bench.Case


def outcome(evicted_by_run: list[tuple[int, list[str]]], runs: dict[int, list[str]], state="succeeded",
            injected=100.0, detected=103.0, localized=107.0) -> dict:
    return {"state": state, "reason": None, "wall_s": 40.0, "injected_at": injected,
            "run_machines": {str(k): {str(i): m for i, m in enumerate(v)} for k, v in runs.items()},
            "incidents": [{"symptom": "x", "mechanism": "evict_restart" if ev else "reattempt", "evicted": ev,
                           "cause": "c", "detected_at": detected, "localized_at": localized, "run": run}
                          for run, ev in evicted_by_run]}


def test_positions_and_chaos_texts():
    assert [bench.machine_index("dp", p) for p in bench.POSITIONS] == [0, 1, 3]
    assert [bench.machine_index("tp-dp", p) for p in bench.POSITIONS] == [0, 1, 2]
    assert bench.chaos_text(Case("nic-flap-once", "dp", "last")) == "nic-flap@step=12,machine=3,times=1,down_s=1"
    assert bench.chaos_text(Case("partition", "dp", "last")) == "partition@step=12,machine=3,peer=0"
    assert bench.chaos_text(Case("fault-free", "dp", "1")) is None
    assert bench.culprits(Case("partition", "tp-dp", "middle")) == [1, 2]
    assert bench.culprits(Case("crash", "dp", "first")) == []


def test_the_smallest_group_is_the_machine_or_a_group_smaller_than_the_job():
    # pure DP: every group is the whole job, so only the machine itself
    assert bench.allowed_sets("dp", 2) == [{2}]
    # TP within a machine, DP across all 3: the machine itself
    assert bench.allowed_sets("tp-dp", 1) == [{1}]
    # 3D, 4 machines: m1 is stage 0 of replica 1: its PP group {1, 3} and DP group {0, 1}
    assert bench.allowed_sets("tp-pp-dp", 1) == [{1}, {1, 3}, {0, 1}]


def test_scoring_a_right_a_wrong_and_an_over_eviction():
    runs = {1: ["m0", "m1", "m2", "m3"], 2: ["m0", "m4", "m2", "m3"]}
    right = bench.score(Case("link-slow", "dp", "middle"), outcome([(1, ["m1"])], runs))
    assert (right["culprit_in"], right["within_group"], right["finished"]) == (True, True, True)
    assert (right["detect_s"], right["localize_s"], right["evicted_per_incident"]) == (3.0, 4.0, 1.0)
    wrong = bench.score(Case("link-slow", "dp", "middle"), outcome([(1, ["m2", "m3"])], runs, state="failed"))
    assert (wrong["culprit_in"], wrong["within_group"], wrong["finished"]) == (False, False, False)
    # 3D: the stage-hang's pipeline group {m1, m3} is over-eviction within the group; {m1, m2} is not
    over = bench.score(Case("stage-hang", "tp-pp-dp", "middle"), outcome([(1, ["m1", "m3"])], runs))
    assert (over["culprit_in"], over["within_group"], over["evicted_per_incident"]) == (True, True, 2.0)
    beyond = bench.score(Case("stage-hang", "tp-pp-dp", "middle"), outcome([(1, ["m1", "m2"])], runs))
    assert (beyond["culprit_in"], beyond["within_group"]) == (True, False)


def test_a_later_incident_maps_the_standby_to_the_slot_it_took():
    runs = {1: ["m0", "m1", "m2", "m3"], 2: ["m0", "m4", "m2", "m3"]}
    # m1 evicted, then its standby m4 (in slot 1) too: both within the culprit's slot
    r = bench.score(Case("sigstop", "dp", "middle"), outcome([(1, ["m1"]), (2, ["m4"])], runs))
    assert (r["culprit_in"], r["within_group"], r["incidents"], r["evicted_per_incident"]) == (True, True, 2, 1.0)


def test_kinds_without_a_culprit_and_fault_free_runs_want_no_eviction():
    runs = {1: ["m0", "m1", "m2", "m3"]}
    crash = bench.score(Case("crash", "dp", "first"), outcome([(1, [])], runs))
    assert crash["culprit_in"] is None and crash["evicted_nothing"]
    ff = bench.score(Case("fault-free", "dp", "1"), outcome([], runs, injected=None))
    assert ff["evicted"] == [] and ff["detect_s"] is None
    bad = bench.score(Case("fault-free", "dp", "2"), outcome([(1, ["m2"])], runs, injected=None))
    s = bench.summarize([ff, bad, crash])
    assert s["fault-free"]["false_evictions"] == 1 and s["fault-free"]["runs"] == 2
    assert s["crash"]["evicted_nothing"] == 1 and s["crash"]["culprit_in_pct"] == "-"
    text = bench.table(s)
    assert "1 false" in text and "1/1 none" in text


def test_summary_percentages_and_times():
    runs = {1: ["m0", "m1", "m2", "m3"]}
    rows = [bench.score(Case("gpu-xid", "dp", p), outcome([(1, [f"m{bench.machine_index('dp', p)}"])], runs,
                                                          detected=100.0 + d, localized=101.0 + d))
            for p, d in zip(bench.POSITIONS, (1.0, 2.0, 6.0))]
    rows.append(bench.score(Case("gpu-xid", "dp", "first"), outcome([(1, ["m2"])], runs)))
    s = bench.summarize(rows)["gpu-xid"]
    assert (s["runs"], s["culprit_in_pct"], s["within_group_pct"], s["finished"]) == (4, "75%", "75%", 4)
    assert s["detect_s"] == "2.5 / 6.0" and s["localize_s"] == "1.0 / 4.0"


def test_bad_selections_are_refused_with_the_known_names():
    with pytest.raises(ValueError, match="unknown kinds warp"):
        bench.parse_list("gpu-xid,warp", list(bench.BY_NAME), "kinds")
    assert bench.parse_list(None, list(bench.LAYOUTS), "layouts") == []


def test_busy_host_runs_are_fault_free_runs_that_must_not_evict():
    runs = {1: ["m0", "m1", "m2"]}
    bad = bench.score(Case("fault-free-busy", "tp-dp", "1"), outcome([(1, ["m2"])], runs, injected=None))
    assert bad["culprit"] == [] and bad["evicted"] == ["m2"]
    s = bench.summarize([bad])["fault-free-busy"]
    assert s["false_evictions"] == 1 and "1 false" in bench.table({"fault-free-busy": s})
    cases = bench.select(["crash"], ["dp"], ["middle"], 1, busy=1, busy_layouts=["tp-dp"])
    assert [c.label for c in cases] == ["crash dp middle", "fault-free dp 1", "fault-free-busy tp-dp 1"]
    assert bench.chaos_text(cases[-1]) is None


def test_the_trace_detector_is_compared_on_late_faults_and_scored_on_its_alerts():
    cases = bench.select(["gpu-hot"], ["dp"], ["middle"], 1, 0, detectors=("off", "on"))
    assert [(c.kind, c.detector, c.late) for c in cases] == [
        ("gpu-hot", "off", True), ("fault-free", "off", True), ("gpu-hot", "on", True), ("fault-free", "on", True)]
    assert bench.chaos_text(cases[2]) == f"gpu-hot@step={bench.TRACE_AT},machine=1"
    assert cases[2].label.endswith("[detector]") and cases[0].label != cases[2].label
    assert [c.late for c in bench.select(["gpu-hot"], ["dp"], ["middle"], 0)] == [False]
    runs = {1: ["m0", "m1", "m2", "m3"]}
    raw = outcome([], runs) | {"alerts": [{"t": 104.0, "machines": ["m2"]}, {"t": 109.0, "machines": ["m1"]}]}
    row = bench.score(cases[2], raw)
    assert (row["alerts"], row["alerts_right"], row["alert_hit"], row["alert_s"]) == (2, 1, True, 9.0)
    ff = bench.score(cases[3], outcome([], runs) | {"alerts": [{"t": 101.0, "machines": ["m0"]}]})
    summary = bench.summarize([row, ff])
    assert (summary["gpu-hot"]["recall"], summary["gpu-hot"]["precision"]) == ("100%", "50%")
    assert (summary["fault-free"]["alerts"], summary["fault-free"]["recall"]) == (1, "-")
    assert "precision" in bench.detector_table(summary)
