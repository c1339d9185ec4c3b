import pytest

from stalwart.spec import JobSpec, Policy, parse_duration


def test_dp_is_derived_and_topology_matches():
    s = JobSpec.from_dict({"machines": 4, "gpus_per_machine": 2, "tp": 2, "pp": 2, "command": ["x"]})
    assert s.dp == 2 and s.topology().world_size == 8
    assert JobSpec.from_dict(s.to_dict()) == s


@pytest.mark.parametrize("d,msg", [
    ({"machines": 4, "gpus_per_machine": 2, "tp": 2, "pp": 2, "dp": 3},
     r"tp\*pp\*dp must equal machines\*gpus-per-machine \(2\*2\*3=12, 4\*2=8\)"),
    ({"machines": 3, "tp": 2}, r"tp\*pp must divide machines\*gpus-per-machine"),
    ({"machines": 2, "steps": 0}, r"steps must be >= 1 \(got 0\)"),
    ({"machines": "2"}, r"machines must be an integer \(got '2'\)"),
    ({"machines": 2, "tpp": 2}, r"unknown field 'tpp' in job spec \(did you mean 'tp'\?\)"),
    ({"machines": 2, "standby": -1}, r"standby must be a number >= 0 or 'auto'"),
    ({"machines": 2, "command": "python x.py"}, r"command must be a list of strings"),
    ({"machines": 2, "chaos": "crash"}, r"chaos must be a list of strings"),
    ({"machines": 2, "policy": {"heartbeat_s": 0}}, r"policy.heartbeat_s must be > 0"),
    ({"machines": 2, "policy": {"missed_beats": 1.5}}, r"policy.missed_beats must be an integer"),
    ({"machines": 2, "policy": {"daily_failure_rate": 2}}, r"policy.daily_failure_rate must be within"),
    ({"machines": 2, "policy": {"heartbeet_s": 1}}, r"unknown field 'heartbeet_s' in policy .did you mean 'heartbeat_s'"),
    ({"machines": 2, "name": ""}, r"name must be a non-empty string"),
])
def test_validation_messages(d, msg):
    with pytest.raises(ValueError, match=msg):
        JobSpec.from_dict(d)


def test_yaml_round_trip_and_errors(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("machines: 2\ngpus_per_machine: 2\ntp: 2\nsteps: 50\ncommand: [python, train.py]\n"
                 "standby: auto\npolicy:\n  heartbeat_s: 0.5\n")
    s = JobSpec.from_yaml(str(p))
    assert (s.dp, s.steps, s.standby, s.policy.heartbeat_s) == (2, 50, "auto", 0.5)
    p.write_text("machines: [\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        JobSpec.from_yaml(str(p))
    p.write_text("machines: 0\n")
    with pytest.raises(ValueError, match=r"job.yaml: machines must be >= 1"):
        JobSpec.from_yaml(str(p))
    with pytest.raises(ValueError, match="cannot read"):
        JobSpec.from_yaml(str(tmp_path / "missing.yaml"))


def test_parse_duration():
    assert parse_duration("24h") == 86400 and parse_duration("90s") == 90
    assert parse_duration("5m") == 300 and parse_duration("1.5") == 1.5 and parse_duration(2) == 2.0
    with pytest.raises(ValueError, match="cannot read duration"):
        parse_duration("soon")


def test_policy_defaults_are_valid():
    Policy().validate()
