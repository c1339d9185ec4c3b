"""An unchanged torchrun-style DDP script (examples/ddp_plain.py) under `stalwart run`, started as
torchrun would be (`stalwart run --nnodes 2 --nproc-per-node 2 train.py ...`, no `--`), with a
worker crash and then a machine loss injected mid-run (`stalwart inject` from another process, as a
user would). It resumes from its own snapshot each time, in the directory it was started from.

What is checked: the job succeeds; the console shows rank 0's own lines with `[rank0]:` prefixes and
a progress line that counts steps (never a target the script cannot have); the snapshot is in the
working directory; the steps the step hook counted are numbered as the script numbers them, across
both restarts (the summary's step count is the script's last step).

ETTR against the SDK: the same execution is booked twice, once from the step hook's reports (the
job's ledger, as the summary prints it) and once from what the SDK would have reported for it: one
step report per step, at the moment it ended, with the script's own step numbers, taken here from
rank 0's log lines (`--log-every 1`: the step, its loss and the time it ended). The two ledgers are
computed on the same event log but for the steps, so the comparison measures the accounting, not
the host: two separate runs on a loaded 2-core host differ by more than the 0.05 allowed in their
start-up alone. Both are compared fault-free (the ledger as of the crash) and at the end (one crash
and one lost machine).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from jobrun import wait_for
from stalwart.backends import statedir
from stalwart.controller.report import ledger
from stalwart.controller.store.db import Store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "ddp_plain.py")
STALWART = os.path.join(os.path.dirname(sys.executable), "stalwart")
STEP_LINE = re.compile(r"^epoch \d+ step (\d+) loss \S+ t (\d+\.\d+)$")
EPOCHS = 120


def _console(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _sdk_steps(state_dir: str) -> list[dict]:
    """The step reports the SDK would have sent: from rank 0's log of each run, in run order."""
    machines = os.path.join(state_dir, "machines")
    runs = sorted((int(m.group(1)), os.path.join(d, name))
                  for d in (os.path.join(machines, x, "logs") for x in os.listdir(machines))
                  for name in os.listdir(d) if (m := re.fullmatch(r"run(\d+)_rank0\.out", name)))
    out = []
    for run, path in runs:
        prev = None
        with open(path) as f:
            for line in f:
                m = STEP_LINE.match(line.strip())
                if m:
                    t = float(m.group(2))
                    out.append({"t": t, "kind": "step", "data": {"run": run, "step": int(m.group(1)) - 1,
                                                                   "dur": t - prev if prev else 0.0}})
                    prev = t
    return out


@pytest.mark.timeout(240)
def test_an_unchanged_ddp_script_survives_a_crash_and_a_lost_machine_and_is_booked_as_the_sdk_would(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(EXAMPLE, work / "train.py")
    (work / "job.yaml").write_text("name: ddp\nmachines: 2\ncommand: [python, train.py]\n"
                                  "policy: {heartbeat_s: 0.5, missed_beats: 4}\n")
    state = str(tmp_path / "state")
    console = str(tmp_path / "console.txt")
    cmd = [STALWART, "run", "--state-dir", state, "--config", "job.yaml", "--nnodes", "2", "--nproc-per-node",
           "2", "--standby", "1", "train.py", "--epochs", str(EPOCHS)]
    with open(console, "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def inject(kind: str, machine: int) -> None:
            subprocess.run([STALWART, "inject", kind, "--machine", str(machine), "--state-dir", state],
                           check=True, timeout=30, capture_output=True)

        def epoch_done(k: int) -> bool:
            return f"[rank0]:epoch {k} done" in _console(console) or proc.poll() is not None
        # the fault-free stretch is long enough to compare ledgers on (a few seconds on a fast host
        # are mostly start-up, and the hook's reporting period weighs in them)
        assert wait_for(lambda: epoch_done(40), timeout=180) and proc.poll() is None, _console(console)[-3000:]
        inject("crash", 1)
        assert wait_for(lambda: "resumed from snapshot.pt" in _console(console) or proc.poll() is not None,
                        timeout=60), _console(console)[-3000:]
        resumed = int(re.search(r"resumed from snapshot.pt: epoch (\d+)", _console(console)).group(1))
        assert wait_for(lambda: epoch_done(resumed + 6), timeout=60) and proc.poll() is None, _console(console)[-3000:]
        inject("machine-down", 0)
        assert wait_for(lambda: proc.poll() is not None, timeout=150), _console(console)[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    text = _console(console)
    assert proc.returncode == 0, text[-3000:]

    # the console: rank 0's own lines, prefixed; the progress line counts steps, with no target
    assert re.search(r"^\[rank0\]:epoch 0 step 1 loss ", text, re.M), text[:3000]
    assert text.count("[rank0]:resumed from snapshot.pt") == 2, text[-3000:]
    assert not re.search(r"^\[rank[123]\]:epoch", text, re.M)          # other ranks' stdout: stalwart logs
    progress = re.findall(r"^step (\d+)  .*ETTR", text, re.M)
    assert progress and max(int(s) for s in progress) > 0 and "/100" not in text, text[-3000:]
    last = max(int(m) for m in re.findall(r"^\[rank0\]:epoch \d+ done: snapshot saved at step (\d+)", text, re.M))
    assert f"steps {last} (counted by the step hook)" in text, text[-1500:]
    # every run's output of a rank, from the state dir
    logs = subprocess.run([STALWART, "logs", "--rank", "0", "--all-runs", "--state-dir", state], capture_output=True,
                          text=True, timeout=30)
    assert logs.returncode == 0 and logs.stdout.count("[rank0]:resumed from snapshot.pt") == 2, logs.stderr
    # the snapshot where the user ran the job, not in a code snapshot
    assert (work / "snapshot.pt").exists()
    assert not [p for p, _, files in os.walk(os.path.join(state, "versions")) if "snapshot.pt" in files]

    store = Store(statedir.db_url(state))
    try:
        job = store.latest_job()
        events = store.events(job["id"])
        incidents = store.incidents(job["id"])
    finally:
        store.close()
    evs = [{"t": e["t"], "kind": e["kind"], "data": e["data"]} for e in events]
    assert [i["symptom"] for i in incidents][:2] == ["worker_crash", "machine_lost"], incidents
    # numbered as the script numbers them: each restart goes on from the step its snapshot holds; the
    # only steps missing are a killed run's last ones whose records died with it (at most a period's:
    # the hook writes every heartbeat), just before a snapshot a later run resumed from
    steps = [e["data"] for e in evs if e["kind"] == "step"]
    kept = sorted({d["step"] for d in steps})
    assert kept[-1] == last - 1 and set(kept) <= set(range(last)), (kept[:5], kept[-5:], last)
    resumes = [min(d["step"] for d in steps if d["run"] == r) for r in sorted({d["run"] for d in steps})][1:]
    resumed_at = [int(s) for s in re.findall(r"^\[rank0\]:resumed from snapshot.pt: epoch \d+, step (\d+)", text, re.M)]
    assert resumes == resumed_at, (resumes, resumed_at)
    missing = set(range(last)) - set(kept)
    assert all(any(r - 40 <= s < r for r in resumes) for s in missing), (sorted(missing), resumes)

    end = max(e["t"] for e in evs)
    sdk = sorted([e for e in evs if e["kind"] != "step"] + _sdk_steps(state), key=lambda e: e["t"])
    crash = min(i["detected_at"] for i in incidents)
    report = {}
    for name, now in (("fault-free", crash), ("crash and lost machine", end)):
        hook, as_sdk = ledger.compute(evs, now), ledger.compute(sdk, now)
        report[name] = (round(hook.ettr, 3), round(as_sdk.ettr, 3))
        assert abs(hook.ettr - as_sdk.ettr) <= 0.05, (name, hook.to_dict(), as_sdk.to_dict())
        assert hook.ettr > 0.0, name
    print("ETTR (step hook, SDK's reports):", json.dumps(report))
