"""The job spec's published JSON Schema and docs: generated from the types and checked in, in
agreement with what `JobSpec.from_dict` accepts, referenced by the API's OpenAPI document and
printed by `stalwart spec schema`; a spec stored in today's form loads unchanged."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from stalwart.cli import main
from stalwart.controller.api import models as api_models
from stalwart.spec import JobSpec, parse_duration
from stalwart.spec import schema as spec_schema
from stalwart.spec.duration import PATTERN

DOCS = Path(__file__).resolve().parents[2] / "docs"
REGENERATE = "python -m stalwart.spec.schema --write docs"
CMD = ["python", "train.py"]


def test_checked_in_schema_is_what_the_types_say():
    checked_in = (DOCS / spec_schema.SCHEMA_FILE).read_text(encoding="utf-8")
    assert checked_in == spec_schema.schema_text(), \
        f"docs/{spec_schema.SCHEMA_FILE} differs from the job spec's types: run `{REGENERATE}`"


def test_docs_field_tables_are_what_the_schema_says():
    doc = (DOCS / spec_schema.DOC_FILE).read_text(encoding="utf-8")
    assert doc == spec_schema.docs_with_fields(doc), \
        f"the fields in docs/{spec_schema.DOC_FILE} differ from the job spec's types: run `{REGENERATE}`"
    for name in ("machines", "command", "standby", "heartbeat_s", "mem_slots", "trace_window_s"):
        assert f"| `{name}` |" in doc, name


def _doc(**kw) -> dict:
    d: dict = {"machines": 2, "command": CMD}
    d.update(kw)
    return d


# What one field says, the schema says too (layout arithmetic, an unparsable shell string and
# an empty first word are the decoder's own checks; JSON Schema counts 2.0 as an integer).
AGREE = [
    (_doc(), True),
    (_doc(name="big-run.1", gpus_per_machine=2, tp=2, steps=50, ckpt_every=5, standby="auto",
          chaos=["crash@step=3,machine=0"], code_dir="/tmp/code", workdir="/tmp/run",
          env={"A": "1", "OMP_NUM_THREADS": 4}, command="python train.py --lr 1e-3"), True),
    (_doc(policy={"hot_update_window_s": "24h", "failslow_period_s": " 1h 30m ", "stop_grace_s": "250ms",
                  "heartbeat_s": 0.5, "missed_beats": 5, "failslow_drop": 0.99, "daily_failure_rate": 0}), True),
    (_doc(steps=2**53 - 1, dp=2, standby=0, policy={"hang_warmup_steps": 0, "replay_k": 0}), True),
    (_doc(machines=0), False),
    (_doc(machines="2"), False),
    (_doc(machines=True), False),
    (_doc(machines=1_000_001), False),
    (_doc(steps=2**53), False),
    (_doc(standby="many"), False),
    (_doc(standby=-1), False),
    (_doc(tpp=2), False),
    ({"machines": 2}, False),
    ({"command": CMD}, False),
    (_doc(command=[]), False),
    (_doc(command=["python", 3]), False),
    (_doc(chaos=[""]), False),
    (_doc(chaos=["  "]), False),
    (_doc(env={"1BAD": "x"}), False),
    (_doc(env={"A": None}), False),
    (_doc(env={"A": True}), False),
    (_doc(name="my job"), False),
    (_doc(name="x" * 64), False),
    (_doc(code_dir=""), False),
    (_doc(policy={"heartbeet_s": 1}), False),
    (_doc(policy={"heartbeat_s": 0}), False),
    (_doc(policy={"heartbeat_s": 1e13}), False),
    (_doc(policy={"stop_grace_s": "later"}), False),
    (_doc(policy={"stop_grace_s": "1h30"}), False),
    (_doc(policy={"stop_grace_s": "-5s"}), False),
    (_doc(policy={"failslow_drop": 1}), False),
    (_doc(policy={"loss_jump_factor": 1}), False),
    (_doc(policy={"mem_slots": 1}), False),
    (_doc(policy={"replay": "yes"}), False),
    (_doc(policy=[1]), False),
]


@pytest.mark.parametrize("doc, accepted", AGREE)
def test_schema_and_decoder_agree(doc, accepted):
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(spec_schema.job_schema())
    try:
        JobSpec.from_dict(doc)
        decoded = True
    except ValueError:
        decoded = False
    assert decoded == accepted
    assert validator.is_valid(doc) == accepted, list(validator.iter_errors(doc))


@pytest.mark.parametrize("text", ["24h", "90s", "5m", "1.5", "250ms", "1d", "1h30m", " 1h 30m ", ".5h", "2H",
                                  "0", "3Ms", "soon", "", "5x", "-5s", "1h30", "h", "1.2.3s", "inf", "nan", " "])
def test_duration_pattern_is_the_parser(text):
    try:
        parse_duration(text)
        parsed = True
    except ValueError:
        parsed = False
    assert (re.fullmatch(PATTERN, text) is not None) == parsed


# A spec as the controller stores it (JobSpec.to_dict, as json.dumps writes it in the jobs table).
STORED = (
    '{"name": "llm-7b", "machines": 4, "gpus_per_machine": 2, "tp": 2, "pp": 1, "dp": 4, "cp": 1, "ep": 1, '
    '"steps": 100, "ckpt_every": 10, "backup_every": "auto", "command": ["python", "train.py", "--lr", "1e-3"], '
    '"standby": "auto", '
    '"chaos": ["crash@step=60,machine=1"], "code_dir": "/srv/code", "workdir": "/srv/run", '
    '"env": {"OMP_NUM_THREADS": "4"}, "policy": {"heartbeat_s": 0.5, "missed_beats": 5, '
    '"max_restarts_without_progress": 3, "network_alert_count": 2, "network_alert_window_s": 300.0, '
    '"hang_timeout_floor_s": 10.0, "hang_safety_factor": 5.0, "hang_warmup_steps": 3, "worker_start_s": 120.0, '
    '"loss_jump_factor": 5.0, '
    '"failslow_rounds": 5, "failslow_period_s": 10.0, "failslow_drop": 0.3, "similarity_window_s": 240.0, '
    '"similarity_continuity_s": 240.0, "similarity_evict": true, "daily_failure_rate": 0.0012, '
    '"hot_update_window_s": 3600.0, "hot_update_prewarm_s": 120.0, "stop_grace_s": 2.0, '
    '"max_standby_wait_s": 60.0, "stop_time_checks": true, "alignment_test": true, "diag_timeout_s": 10.0, '
    '"replay": true, "replay_k": 0, "replay_steps": 6, "replay_timeout_s": 90.0, "ladder_window_s": 3600.0, '
    '"mem_slots": 4, "over_evict": true, "warm_spares": true, "trace_detector": true, "trace_evict": false, '
    '"trace_train_s": 120.0, "trace_window_s": 5.0}}')


def test_a_stored_spec_loads_and_is_written_back_byte_for_byte():
    spec = JobSpec.from_dict(json.loads(STORED))
    assert (spec.dp, spec.standby, spec.policy.hot_update_window_s, spec.policy.missed_beats) == (4, "auto", 3600.0, 5)
    assert json.dumps(spec.to_dict()) == STORED
    # a partial spec (only what a user wrote) fills in the same defaults
    partial = JobSpec.from_dict({"name": "llm-7b", "machines": 4, "gpus_per_machine": 2, "tp": 2,
                                 "command": ["python", "train.py", "--lr", "1e-3"], "standby": "auto",
                                 "chaos": ["crash@step=60,machine=1"], "code_dir": "/srv/code",
                                 "workdir": "/srv/run", "env": {"OMP_NUM_THREADS": 4},
                                 "policy": {"heartbeat_s": 0.5, "hot_update_window_s": "1h", "missed_beats": 5}})
    assert partial == spec and json.dumps(partial.to_dict()) == STORED


def test_openapi_gives_the_job_schema_for_the_submitted_spec():
    doc = api_models.openapi(api_models.ROUTES, "test")
    schemas = doc["components"]["schemas"]
    assert schemas["SubmitJob"]["properties"]["spec"]["$ref"] == "#/components/schemas/JobSpec"
    ref, defs = spec_schema.components("#/components/schemas/{name}")
    assert schemas["JobSpec"] == defs["JobSpec"] and schemas["Policy"] == defs["Policy"]
    assert schemas["JobSpec"]["properties"]["policy"]["$ref"] == "#/components/schemas/Policy"


def test_cli_prints_the_schema_and_checks_a_spec(tmp_path, capsys):
    assert main(["spec", "schema"]) == 0
    assert capsys.readouterr().out == spec_schema.schema_text()
    job = tmp_path / "job.yaml"
    job.write_text("machines: 2\ncommand: python train.py\npolicy:\n  stop_grace_s: 5m\n")
    assert main(["spec", "check", str(job)]) == 0
    out = capsys.readouterr().out
    assert "\ndp: 2\n" in out and "\n  stop_grace_s: 300.0\n" in out and "\ncommand:\n- python\n- train.py\n" in out
    job.write_text("machines: 2\ncommand: [x]\npolicy:\n  missed_beats: 0\n")
    assert main(["spec", "check", str(job)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: job spec {job}: policy.missed_beats must be >= 1 (got 0)\n"
