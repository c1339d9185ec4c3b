"""JobSpec / Policy validation (every branch), conversions and YAML round trips."""

from __future__ import annotations

import os

import msgspec
import pytest

from stalwart.spec import JobSpec, Policy, parse_duration
from stalwart.topology import Topology

CMD = ["python", "train.py"]


def spec(**kw) -> dict:
    d = {"machines": 2, "command": CMD}
    d.update(kw)
    return d


# ------------------------------------------------------------------ durations
@pytest.mark.parametrize("text, seconds", [
    ("24h", 86400.0), ("90s", 90.0), ("5m", 300.0), ("1.5", 1.5), ("250ms", 0.25),
    ("1d", 86400.0), ("1h30m", 5400.0), (" 1h 30m ", 5400.0), (".5h", 1800.0), ("2H", 7200.0),
    ("0", 0.0), (2, 2.0), (0.25, 0.25),
])
def test_parse_duration_accepts(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["soon", "", "5x", "-5s", "1h30", "h", "1.2.3s", "inf", "nan",
                                 None, True, [], -1, float("inf"), float("nan")])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError, match=r"^invalid duration .*\(.*\)$"):
        parse_duration(bad)


# --------------------------------------------------------------------- policy
def test_policy_defaults():
    p = Policy()
    assert (p.heartbeat_s, p.missed_beats, p.network_alert_count, p.network_alert_window_s) == \
        (1.0, 3, 2, 300.0)
    assert (p.loss_jump_factor, p.failslow_rounds, p.failslow_period_s, p.failslow_drop) == \
        (5.0, 5, 10.0, 0.3)
    assert (p.hot_update_window_s, p.stop_grace_s, p.max_standby_wait_s) == (86400.0, 2.0, 60.0)
    # every field is documented in its type (where the JSON Schema and docs/jobspec.md read it)
    for struct in (Policy, JobSpec):
        for f in msgspec.structs.fields(struct):
            assert "description=" in repr(f.type), f"{struct.__name__}.{f.name}"


@pytest.mark.parametrize("field, bad, msg", [
    ("heartbeat_s", 0, r"policy.heartbeat_s must be > 0 \(got 0\)"),
    ("heartbeat_s", "fast", r"policy.heartbeat_s must be a number \(got 'fast'\)"),
    ("heartbeat_s", True, r"policy.heartbeat_s must be a number \(got True\)"),
    ("heartbeat_s", float("nan"), r"policy.heartbeat_s must be a number"),
    ("missed_beats", 0, r"policy.missed_beats must be >= 1 \(got 0\)"),
    ("missed_beats", 1.5, r"policy.missed_beats must be an integer \(got 1.5\)"),
    ("max_restarts_without_progress", 0, r"policy.max_restarts_without_progress must be >= 1"),
    ("network_alert_count", -1, r"policy.network_alert_count must be >= 1 \(got -1\)"),
    ("network_alert_window_s", 0.0, r"policy.network_alert_window_s must be > 0"),
    ("hang_timeout_floor_s", -1, r"policy.hang_timeout_floor_s must be > 0 \(got -1\)"),
    ("hang_safety_factor", 0.5, r"policy.hang_safety_factor must be >= 1 \(got 0.5\)"),
    ("hang_warmup_steps", -1, r"policy.hang_warmup_steps must be >= 0 \(got -1\)"),
    ("loss_jump_factor", 1, r"policy.loss_jump_factor must be > 1 \(got 1\)"),
    ("failslow_rounds", 0, r"policy.failslow_rounds must be >= 1"),
    ("failslow_period_s", 0, r"policy.failslow_period_s must be > 0"),
    ("failslow_drop", 0, r"policy.failslow_drop must be > 0 \(got 0\)"),
    ("failslow_drop", 1, r"policy.failslow_drop must be < 1 \(got 1\)"),
    ("similarity_window_s", 0, r"policy.similarity_window_s must be > 0"),
    ("daily_failure_rate", -0.1, r"policy.daily_failure_rate must be >= 0 \(got -0.1\)"),
    ("daily_failure_rate", 1, r"policy.daily_failure_rate must be < 1 \(got 1\)"),
    ("hot_update_window_s", -1, r"policy.hot_update_window_s must be >= 0"),
    ("stop_grace_s", -0.5, r"policy.stop_grace_s must be >= 0 \(got -0.5\)"),
    ("max_standby_wait_s", -1, r"policy.max_standby_wait_s must be >= 0"),
])
def test_policy_rejects(field, bad, msg):
    with pytest.raises(ValueError, match=f"^{msg}"):
        Policy(**{field: bad})
    with pytest.raises(ValueError, match=rf"^policy\.{field}"):   # named through a job spec
        JobSpec.from_dict(spec(policy={field: bad}))


def test_policy_boundaries_accepted():
    p = Policy(hang_safety_factor=1, hang_warmup_steps=0, daily_failure_rate=0,
               hot_update_window_s=0, stop_grace_s=0, max_standby_wait_s=0)
    assert p.hang_safety_factor == 1.0 and isinstance(p.hang_safety_factor, float)


def test_policy_from_dict():
    p = Policy.from_dict({"hot_update_window_s": "24h", "failslow_period_s": "90s",
                          "missed_beats": 5})
    assert (p.hot_update_window_s, p.failslow_period_s, p.missed_beats) == (86400.0, 90.0, 5)
    assert Policy.from_dict(None) == Policy()
    assert Policy.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match=r"^policy.stop_grace_s: invalid duration 'later'"):
        Policy.from_dict({"stop_grace_s": "later"})
    with pytest.raises(ValueError, match=r"policy.missed_beats must be an integer \(got '3'\)"):
        Policy.from_dict({"missed_beats": "3"})
    with pytest.raises(ValueError, match=r"^unknown field 'heartbeet_s' in policy "
                                         r"\(did you mean 'heartbeat_s'\?\)$"):
        Policy.from_dict({"heartbeet_s": 1})
    with pytest.raises(ValueError, match=r"^unknown field 'zzz' in policy \(known: heartbeat_s, "):
        Policy.from_dict({"zzz": 1})
    with pytest.raises(ValueError, match=r"^policy must be a mapping \(got list\)$"):
        Policy.from_dict([1])


# -------------------------------------------------------------------- JobSpec
def test_defaults_and_derived_dp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = JobSpec(machines=4, gpus_per_machine=2, tp=2, pp=2, command=["x"])
    assert s.dp == 2 and s.name == "job" and s.steps == 100 and s.ckpt_every == 10
    assert s.standby == 0 and s.chaos == [] and s.env == {} and s.policy == Policy()
    assert s.code_dir == str(tmp_path)
    assert s.topology() == Topology(4, 2, tp=2, pp=2, dp=2)
    assert JobSpec(machines=2, gpus_per_machine=4, tp=2, cp=2, command=["x"]).dp == 2
    assert JobSpec(machines=2, gpus_per_machine=4, ep=4, command=["x"]).topology().ep == 4


def test_normalisation():
    s = JobSpec.from_dict(spec(command="python train.py --lr '1e-3'", code_dir="rel/dir",
                               env={"OMP_NUM_THREADS": 4, "X": "y", "R": 0.5},
                               standby="auto", policy={"heartbeat_s": 1}))
    assert s.command == ["python", "train.py", "--lr", "1e-3"]
    assert s.code_dir == os.path.abspath("rel/dir")
    assert s.env == {"OMP_NUM_THREADS": "4", "X": "y", "R": "0.5"}
    assert s.standby == "auto" and s.policy.heartbeat_s == 1.0
    assert JobSpec.from_dict(spec(command=("a", "b"))).command == ["a", "b"]


@pytest.mark.parametrize("d, msg", [
    ({"machines": 4, "gpus_per_machine": 2, "tp": 2, "pp": 2, "dp": 3, "command": CMD},
     r"^tp\*pp\*dp must equal machines\*gpus-per-machine \(2\*2\*3=12, 4\*2=8\)$"),
    ({"machines": 2, "gpus_per_machine": 2, "cp": 2, "dp": 1, "command": CMD},
     r"^tp\*pp\*dp\*cp must equal machines\*gpus-per-machine \(1\*1\*1\*2=2, 2\*2=4\)$"),
    (spec(machines=3, tp=2), r"^dp = machines\*gpus_per_machine/\(tp\*pp\*cp\*ep\) = 3/2 is not "
                             r"an integer; change the layout or set dp$"),
    (spec(machines=0), r"^machines must be >= 1 \(got 0\)$"),
    (spec(machines="2"), r"^machines must be an integer \(got '2'\)$"),
    (spec(machines=2.0), r"^machines must be an integer \(got 2.0\)$"),
    (spec(gpus_per_machine=0), r"^gpus_per_machine must be >= 1 \(got 0\)$"),
    (spec(tp=0), r"^tp must be >= 1 \(got 0\)$"),
    (spec(pp=True), r"^pp must be an integer \(got True\)$"),
    (spec(cp=-1), r"^cp must be >= 1 \(got -1\)$"),
    (spec(ep="2"), r"^ep must be an integer \(got '2'\)$"),
    (spec(dp=0), r"^dp must be >= 1 \(got 0\)$"),
    (spec(dp=1.5), r"^dp must be an integer \(got 1.5\)$"),
    (spec(steps=0), r"^steps must be >= 1 \(got 0\)$"),
    (spec(ckpt_every=0), r"^ckpt_every must be >= 1 \(got 0\)$"),
    (spec(ckpt_every="10"), r"^ckpt_every must be an integer \(got '10'\)$"),
    (spec(tpp=2), r"^unknown field 'tpp' in job spec \(did you mean 'tp'\?\)$"),
    (spec(machine=2), r"^unknown field 'machine' in job spec \(did you mean 'machines'\?\)$"),
    (spec(qqq=1), r"^unknown field 'qqq' in job spec \(known: name, machines, "),
    ({"command": CMD}, r"^job spec is missing required field 'machines'$"),
    ({"machines": 2}, r"^job spec is missing required field 'command'$"),
    (spec(command=[]), r"^command must be a non-empty list of strings \(got \[\]\)$"),
    (spec(command=["python", 3]), r"^command must be a non-empty list of strings"),
    (spec(command=[""]), r"^command must be a non-empty list of strings"),
    (spec(command=5), r"^command must be a non-empty list of strings \(got 5\)$"),
    (spec(command="python 'unclosed"), r"^command cannot be parsed \(No closing quotation\)"),
    (spec(standby=-1), r"^standby must be >= 0 \(got -1\)$"),
    (spec(standby="many"), r"^standby must be an integer >= 0 or 'auto' \(got 'many'\)$"),
    (spec(standby=1.5), r"^standby must be an integer \(got 1.5\)$"),
    (spec(chaos="crash"), r"^chaos must be a list of non-empty strings \(got 'crash'\)$"),
    (spec(chaos=["crash@step=1", ""]), r"^chaos must be a list of non-empty strings"),
    (spec(chaos=[3]), r"^chaos must be a list of non-empty strings"),
    (spec(code_dir=""), r"^code_dir must be a path string \(got ''\)$"),
    (spec(code_dir=3), r"^code_dir must be a path string \(got 3\)$"),
    (spec(env=["A=1"]), r"^env must be a mapping of names to strings"),
    (spec(env={"1BAD": "x"}), r"^env name must be a valid variable name \(got '1BAD'\)$"),
    (spec(env={"A": None}), r"^env.A must be a string \(got None\)$"),
    (spec(env={"A": [1]}), r"^env.A must be a string"),
    (spec(name=""), r"^name must be 1-63 letters, digits or _.- starting with a letter or digit"),
    (spec(name="my job"), r"\(got 'my job'\)$"),
    (spec(name="x" * 64), r"^name must be 1-63"),
    (spec(name=5), r"\(got 5\)$"),
    (spec(policy=[1]), r"^policy must be a mapping \(got list\)$"),
    ([1, 2], r"^job spec must be a mapping \(got list\)$"),
])
def test_job_spec_rejects(d, msg):
    with pytest.raises(ValueError, match=msg):
        JobSpec.from_dict(d)


@pytest.mark.parametrize("d, msg", [
    ({**spec(), 1: 2}, r"^unknown field 1 in job spec \(known: name, "),
    (spec(policy={2: 1}), r"^unknown field 2 in policy \(known: heartbeat_s, "),
    (spec(env={1: "x"}), r"^env name must be a valid variable name \(got 1\)$"),
    (spec(steps=10**100), r"^steps must be <= 9007199254740991 \(got 1000000000"),
    (spec(policy={"heartbeat_s": 10**400}), r"^policy.heartbeat_s must be a finite number"),
    (spec(policy={"hang_safety_factor": float("inf")}), r"^policy.hang_safety_factor must be <= 1e\+12 \(got inf\)$"),
])
def test_odd_values_are_named(d, msg):
    with pytest.raises(ValueError, match=msg):
        JobSpec.from_dict(d)


def test_constructor_validates_and_validate_rechecks():
    with pytest.raises(ValueError, match=r"^steps must be >= 1 \(got -3\)$"):
        JobSpec(machines=1, command=["x"], steps=-3)
    with pytest.raises(ValueError, match=r"^policy must be a mapping \(got int\)$"):
        JobSpec(machines=1, command=["x"], policy=3)
    s = JobSpec(machines=1, command=["x"], policy={"missed_beats": 7})
    assert s.policy.missed_beats == 7
    s.steps = 0
    with pytest.raises(ValueError, match=r"^steps must be >= 1 \(got 0\)$"):
        s.validate()


def test_dict_round_trip():
    s = JobSpec.from_dict(spec(name="big-run.1", machines=4, gpus_per_machine=2, tp=2, pp=2,
                               steps=50, ckpt_every=5, standby=1, chaos=["crash@step=3,machine=0"],
                               code_dir="/tmp/code", env={"A": "1"},
                               policy={"heartbeat_s": 0.5, "hot_update_window_s": "1h"}))
    d = s.to_dict()
    assert d["policy"]["hot_update_window_s"] == 3600.0 and d["dp"] == 2
    assert JobSpec.from_dict(d) == s
    d["command"].append("mutated")   # to_dict is a copy
    assert s.command == CMD


def test_yaml_round_trip(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("name: demo\nmachines: 2\ngpus_per_machine: 2\ntp: 2\nsteps: 50\n"
                 "command: [python, train.py]\nstandby: auto\ncode_dir: code\n"
                 "env:\n  OMP_NUM_THREADS: 2\nchaos:\n  - crash@step=60,machine=1\n"
                 "policy:\n  heartbeat_s: 0.5\n  hot_update_window_s: 24h\n")
    s = JobSpec.from_yaml(p)
    assert (s.name, s.dp, s.steps, s.standby, s.policy.heartbeat_s) == ("demo", 2, 50, "auto", 0.5)
    assert s.policy.hot_update_window_s == 86400.0 and s.env == {"OMP_NUM_THREADS": "2"}
    assert s.code_dir == str(tmp_path / "code")      # relative to the YAML file
    q = tmp_path / "again.yaml"
    q.write_text(s.to_yaml())
    assert JobSpec.from_yaml(str(q)) == s


def test_yaml_errors(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("machines: [\n")
    with pytest.raises(ValueError, match=r"job.yaml line \d+ is not valid YAML: "):
        JobSpec.from_yaml(p)
    p.write_text("machines: 0\ncommand: [x]\n")
    with pytest.raises(ValueError, match=r"job.yaml: machines must be >= 1 \(got 0\)$"):
        JobSpec.from_yaml(p)
    p.write_text("machines: two\ncommand: [x]\n")
    with pytest.raises(ValueError, match=r"job.yaml: machines must be an integer \(got 'two'\)$"):
        JobSpec.from_yaml(p)
    p.write_text("machines: 1\ncommand: [x]\npolicy:\n  heartbeat: 1\n")
    with pytest.raises(ValueError, match=r"unknown field 'heartbeat' in policy \(did you mean "):
        JobSpec.from_yaml(p)
    p.write_text("machines: 1\ncommand: [x]\npolicy: 3\n")
    with pytest.raises(ValueError, match=r"job.yaml: policy must be a mapping \(got int\)$"):
        JobSpec.from_yaml(p)
    p.write_text("")
    with pytest.raises(ValueError, match=r"job.yaml: job spec must be a mapping \(got NoneType\)"):
        JobSpec.from_yaml(p)
    with pytest.raises(ValueError, match=r"^cannot read job spec .*missing.yaml: "):
        JobSpec.from_yaml(tmp_path / "missing.yaml")
