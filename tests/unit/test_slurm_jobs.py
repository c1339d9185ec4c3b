"""Finding a Slurm job's stalwart state from its id (`--slurm-job`): the registry written at
submission, then the job's comment; and what `stalwart logs` shows of a state dir."""
from __future__ import annotations

import pytest

from stalwart.backends import slurm_alloc
from stalwart.backends.slurm import JobInfo
from stalwart.cli import main
from stalwart.cli.logs import service_logs
from stalwart.errors import UserError


def test_a_slurm_jobs_state_dir_from_the_registry_or_its_comment(tmp_path, monkeypatch):
    monkeypatch.setenv(slurm_alloc.REGISTRY_ENV, str(tmp_path / "registry"))
    slurm_alloc.remember("4242", str(tmp_path / "llm"))
    assert slurm_alloc.state_dir_of("4242") == str(tmp_path / "llm")
    asked = []

    def job_info(job_id):
        asked.append(job_id)
        return JobInfo(job_id, "RUNNING", comment="stalwart:/shared/other") if job_id == "7" else None
    monkeypatch.setattr(slurm_alloc, "job_info", job_info)
    assert slurm_alloc.state_dir_of("7") == "/shared/other" and asked == ["7"]
    with pytest.raises(UserError, match="Slurm job 8 is not a stalwart job"):
        slurm_alloc.state_dir_of("8")
    with pytest.raises(UserError, match="takes a Slurm job id"):
        slurm_alloc.state_dir_of("llm")


def test_logs_shows_a_ranks_newest_run_an_agent_or_the_controller(tmp_path, monkeypatch, capsys):
    logs = tmp_path / "machines" / "m2" / "logs"
    logs.mkdir(parents=True)
    (logs / "run2_rank0.out").write_text("old run\n")
    (logs / "run10_rank0.out").write_text("".join(f"step {i}\n" for i in range(100)))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "controller.log").write_text("controller up\n")
    (tmp_path / "slurm" / "logs").mkdir(parents=True)
    (tmp_path / "slurm" / "logs" / "slurm-9.out").write_text("stalwart: job 1 submitted\n")
    assert main(["logs", "--state-dir", str(tmp_path), "--rank", "0"]) == 0
    out = capsys.readouterr().out.splitlines()          # the newest run's (10, not 2)
    assert len(out) == 100 and out[0] == "[rank0]:step 0" and out[-1] == "[rank0]:step 99"
    assert service_logs(str(tmp_path), None, "9") == [str(tmp_path / "logs" / "controller.log"),
                                                      str(tmp_path / "slurm" / "logs" / "slurm-9.out")]
    monkeypatch.setenv(slurm_alloc.REGISTRY_ENV, str(tmp_path / "registry"))
    slurm_alloc.remember("9", str(tmp_path))
    assert main(["logs", "--slurm-job", "9", "--controller-log", "-n", "5"]) == 0
    out = capsys.readouterr().out
    assert "controller up" in out and "stalwart: job 1 submitted" in out
    assert main(["logs", "--state-dir", str(tmp_path), "--machine", "m7"]) == 2
    assert capsys.readouterr().err.startswith("error: no machine m7's agent log")
