"""The scripts of examples/ under `stalwart run`, each with a worker crash and a machine loss
injected mid-run, resuming from the in-memory tier.

Each example is an ordinary script of its kind (FSDP2 + DCP, Lightning, Hugging Face Trainer)
with stalwart's adapter added; rank 0 prints each step's loss exactly (`repr`), so a step trained
twice (before the fault and again after the restore) must print the same loss twice: the restore
put back the model, the optimizer and the framework's position bit for bit. The job runs on two
machines of one rank each and one standby: the crash is reattempted on the same machines, the lost
machine is replaced by the standby, and the machine's rank restores from its backup peer's memory.
Backups go every step (`--backup-every 1`, not paced by their cost), the pace that bounds a lost
machine's loss to one step, which the test checks.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 24
# (durable copies every 10 steps, of steps 9 and 19: neither fault finds one of the step it needs)
CHAOS = ["crash@step=6,machine=1", "machine-down@step=15,machine=1"]
LINE = re.compile(r"^step (\d+) loss (\S+)$")


def _stalwart(*args: str, timeout: float, cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    proc = subprocess.Popen([sys.executable, "-m", "stalwart.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)      # `stalwart run` stops what it started on Ctrl-C
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise AssertionError(f"stalwart {args[0]} did not finish in {timeout}s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _run_example(tmp_path, script: str, timeout: float = 240.0) -> tuple[dict, dict[int, list[str]], str]:
    state = str(tmp_path / "state")
    cmd = ["run", "--state-dir", state, "--fresh", "--machines", "2", "--gpus-per-machine", "1",
           "--standby", "1", "--steps", str(STEPS), "--ckpt-every", "10", "--backup-every", "1"]
    for c in CHAOS:
        cmd += ["--chaos", c]
    try:
        out = _stalwart(*cmd, "--", sys.executable, os.path.join(ROOT, "examples", script),
                        "--steps", str(STEPS), timeout=timeout, cwd=str(tmp_path))
    finally:
        subprocess.run([sys.executable, "-m", "stalwart.cli", "cleanup", "--state-dir", state],
                       capture_output=True, timeout=60)
    assert out.returncode == 0, out.stdout[-4000:]
    rep_path = str(tmp_path / "report.json")
    got = _stalwart("report", "--state-dir", state, "--json", rep_path, timeout=60, cwd=str(tmp_path))
    assert got.returncode == 0, got.stdout
    with open(rep_path) as f:
        rep = json.load(f)
    seen: dict[int, list[str]] = {}
    text = ""
    for path in sorted(glob.glob(os.path.join(state, "machines", "*", "logs", "*.out"))):
        with open(path, errors="replace") as f:
            for line in f:
                text += line
                m = LINE.match(line.strip())
                if m:
                    seen.setdefault(int(m.group(1)), []).append(m.group(2))
    return rep, seen, text


def _check(rep: dict, seen: dict[int, list[str]], name: str) -> list[int]:
    """The faults were handled as intended and resumed from memory; the steps each lost."""
    assert rep["state"] == "succeeded", rep.get("reason")
    assert rep["steps_completed"] == STEPS
    assert [(i["symptom"], i["mechanism"]) for i in rep["incidents"]] == \
        [("worker_crash", "reattempt"), ("machine_lost", "evict_restart")]
    runs = rep["runs"]
    assert len(runs) == 3
    assert runs[-1]["machines"] == {"0": "m0", "1": "m2"}          # the standby took m1's rank
    lost = []
    for before, after in zip(runs, runs[1:]):
        restore = after["restore"]
        assert restore is not None, after
        assert set(restore["tiers"].values()) <= {"own", "backup"}, restore   # the in-memory tier
        # the steps the run before had committed past the restored one, trained again (a framework
        # whose snapshot precedes its step report restores a step the controller had not committed)
        lost.append(max(0, before["end_step"] - (restore["step"] + 1)))
    assert runs[-1]["restore"]["tiers"]["1"] == "backup"          # m1's memory died with it
    assert all(n <= 1 for n in lost), lost
    for step, values in seen.items():                                # redone steps: bit for bit
        assert len(set(values)) == 1, (step, values)
    first, last = min(seen), max(seen)
    assert float(seen[last][0]) < float(seen[first][0])
    print(f"{name}: steps lost per fault {lost}, report steps_lost {rep['steps_lost']}, "
          f"wall {rep['wall_s']:.1f}s, ETTR {rep['ettr']:.3f}")
    return lost


@pytest.mark.timeout(300)
def test_fsdp2_dcp_resumes_from_memory(tmp_path):
    rep, seen, text = _run_example(tmp_path, "fsdp2_dcp.py")
    _check(rep, seen, "fsdp2_dcp")
    assert sorted(seen) == list(range(STEPS))      # every step printed, the redone ones twice
    assert "final loss" in text and "adapter: 1 plan" in text   # every save after the first reused the plan


@pytest.mark.timeout(300)
def test_lightning_resumes_from_memory(tmp_path):
    pytest.importorskip("lightning")
    rep, seen, text = _run_example(tmp_path, "lightning_train.py")
    _check(rep, seen, "lightning")
    assert f"final step {STEPS}" in text


@pytest.mark.timeout(300)
def test_hf_trainer_resumes_from_memory(tmp_path):
    pytest.importorskip("transformers")
    rep, seen, text = _run_example(tmp_path, "hf_trainer.py")
    _check(rep, seen, "hf_trainer")
    assert f"final step {STEPS}" in text
