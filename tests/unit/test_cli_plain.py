"""`stalwart run` as torchrun's replacement: torchrun's options and command forms, the script
checked before anything starts, the workers' output with rank prefixes, and the progress line of a
plain script (steps it saw, never a target it cannot know)."""
import io
import sys

import pytest

from stalwart.cli import build_parser
from stalwart.cli.common import UserError, spec_from_args
from stalwart.cli.logs import LogTail, parse_ranks
from stalwart.console.progress import Progress, summary


def spec(argv):
    return spec_from_args(build_parser().parse_args(["run", *argv]))


def test_a_torchrun_line_becomes_a_stalwart_line_by_its_first_word(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    s = spec(["--nnodes", "2", "--nproc-per-node", "2", "train.py", "--epochs", "3"])
    assert (s.machines, s.gpus_per_machine, s.dp) == (2, 2, 4)
    assert s.command == [sys.executable, "train.py", "--epochs", "3"]
    assert s.workdir == str(tmp_path) and s.code_dir == str(tmp_path)
    assert spec(["--nnodes", "1", "--nproc_per_node=2", "--", "python", "train.py"]).command == [
        sys.executable, "train.py"]
    assert spec(["--nnodes", "1", "-m", "json.tool", "--x"]).command == [sys.executable, "-m", "json.tool", "--x"]
    assert spec(["--nnodes", "1", "--no-python", "true"]).command == ["true"]
    s = spec(["--nnodes", "1:3", "--max-restarts", "3", "--rdzv-backend", "c10d", "--standalone", "train.py"])
    assert s.machines == 3
    err = capsys.readouterr().err
    assert "elastic ranges are not used" in err and "--max-restarts is not used" in err
    assert "--rdzv-backend is not used" in err and "--standalone is what stalwart run always is" in err


@pytest.mark.parametrize("argv, says", [
    (["--nnodes", "1", "nosuch.py"], "script nosuch.py does not exist"),
    (["--nnodes", "1", "-m", "nosuchmodule_xyz"], "module nosuchmodule_xyz not found"),
    (["--nnodes", "1", "--no-python", "nosuch-command-xyz"], "command nosuch-command-xyz not found on PATH"),
    (["--nnodes", "2", "--machines", "3", "train.py"], "--nnodes 2 and --machines 3 disagree"),
    (["--nnodes", "x", "train.py"], "--nnodes takes a number or MIN:MAX"),
    (["--nnodes", "1", "--nproc-per-node", "auto", "train.py"], "--nproc-per-node takes a number"),
])
def test_a_wrong_command_line_is_one_line_before_anything_starts(tmp_path, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    with pytest.raises(UserError, match=says.replace("(", r"\(")):
        spec(argv)


def test_the_console_shows_rank_0_and_every_ranks_stderr_with_prefixes(tmp_path):
    logs = tmp_path / "machines" / "m0" / "logs"
    logs.mkdir(parents=True)
    (logs / "run1_rank0.out").write_text("old job's line\n")
    tail = LogTail(str(tmp_path), ranks=parse_ranks("0"))
    (logs / "run1_rank0.out").write_text("old job's line\nepoch 0 loss 1.0\npart")
    (logs / "run1_rank1.out").write_text("rank 1 talks\n")
    # (torch's exception hook prefixes a rank's traceback itself: not twice)
    (logs / "run1_rank1.err").write_text("Traceback (most recent call last):\n[rank1]:RuntimeError: x\n")
    assert tail.lines() == ["[rank0]:epoch 0 loss 1.0", "[rank1]:Traceback (most recent call last):",
                            "[rank1]:RuntimeError: x"]
    with open(logs / "run1_rank0.out", "a") as f:
        f.write("ial line\n")
    (logs / "run2_rank0.out").write_text("after the restart\n")
    assert tail.lines() == ["[rank0]:partial line", "[rank0]:after the restart"]
    assert parse_ranks("all") is None and parse_ranks("none") == set() and parse_ranks("0,2-3") == {0, 2, 3}
    with pytest.raises(UserError):
        parse_ranks("x")


def test_a_plain_scripts_progress_line_counts_steps_and_shows_no_target():
    out = io.StringIO()
    prog = Progress(stream=out, target_given=False)
    base = {"state": "running", "ettr": 0.5, "productive_s": 2.0, "steps_target": 100, "incidents": []}
    prog.update({**base, "live": {"step": 0, "run": 1, "state": "running"}})
    prog.update({**base, "live": {"step": 40, "run": 1, "state": "running", "script": True, "steps_per_s": 12.5}})
    text = out.getvalue()
    assert "/100" not in text and "step 40  12.5 steps/s  ETTR 0.500" in text
    # an SDK job: the target shows once its steps come (the SDK trains that many)
    out = io.StringIO()
    Progress(stream=out, target_given=False).update({**base, "live": {"step": 20, "run": 1, "state": "running"}})
    assert "step 20/100" in out.getvalue()
    rep = {"job": "j#1", "state": "succeeded", "steps_completed": 96, "steps_target": None,
           "steps_source": "script", "final_loss": None, "wall_s": 10.0, "productive_s": 8.0, "ettr": 0.8,
           "unproductive_s": {"startup": 2.0}, "incidents": []}
    assert "steps 96 (counted by the step hook)" in summary(rep)
    # a job that reported no step and was given no target: no target, no loss to speak of
    quiet = {**rep, "steps_completed": 0, "steps_target": 100, "steps_source": "sdk"}
    assert summary(quiet, target_given=False).splitlines()[1] == "  steps 0"
    assert summary({**quiet, "final_loss": 2.5}).splitlines()[1] == "  steps 0/100, final loss 2.5"


def test_logs_of_a_rank_that_wrote_nothing_say_so(tmp_path, capsys):
    from stalwart.cli import main
    logs = tmp_path / "machines" / "m0" / "logs"
    logs.mkdir(parents=True)
    (logs / "run1_rank1.out").write_text("before the crash\n")
    for name in ("run2_rank0.out", "run2_rank1.out", "run2_rank1.err"):
        (logs / name).write_text("step 3\n" if name == "run2_rank0.out" else "")
    assert main(["logs", "--rank", "1", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == "stalwart: rank 1 wrote nothing in run 2 (--all-runs for the earlier runs)\n"
    assert main(["logs", "--rank", "1", "--all-runs", "--state-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "[rank1]:before the crash\n"


def test_the_progress_line_says_no_ettr_before_a_step_and_keeps_the_step_across_a_restart():
    out = io.StringIO()
    prog = Progress(stream=out, target_given=False)
    prog.update({"state": "running", "ettr": 0.0, "productive_s": 0.0, "incidents": [],
                 "live": {"run": 1, "state": "starting"}})
    assert "ETTR -" in prog.last_line and "ETTR 0.000" not in prog.last_line
    # the new run has not reported a step yet: the line keeps the job's steps, not 0
    prog.update({"state": "running", "ettr": 0.8, "productive_s": 8.0, "steps_completed": 60, "incidents": [],
                 "live": {"step": 0, "run": 2, "state": "running"}})
    assert "step 60" in prog.last_line and "ETTR 0.800" in prog.last_line
