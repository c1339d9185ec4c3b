"""The flight-recorder hook in real processes (worker/frhook.py through hookdir/sitecustomize.py) and
the agent's progress sampler (agent/progress.py) on real workers: CPU time, logs, recorder summaries."""
import json
import os
import subprocess
import sys
import time

import pytest

from jobrun import wait_for
from stalwart import protocol as p
from stalwart.agent.progress import ProgressWatch, hook_env
from stalwart.agent.workers import WorkerSet

GLOO = """
import datetime, time, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
t = torch.ones(4)
for _ in range(5):
    dist.all_reduce(t)
print("ready", flush=True)
time.sleep(60)
"""


def run_hooked(tmp_path, code, extra_path=None, env=None):
    fr = tmp_path / "fr"
    fr.mkdir(exist_ok=True)
    base = dict(os.environ, RANK="3", **(env or {}))
    base.pop("PYTHONPATH", None)
    if extra_path:
        base["PYTHONPATH"] = str(extra_path)
    return subprocess.Popen([sys.executable, "-c", code], env=hook_env(base, str(fr), 0.2),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), fr


@pytest.mark.timeout(120)
def test_hook_writes_the_recorder_summary_of_a_gloo_process(tmp_path):
    proc, fr = run_hooked(tmp_path, GLOO)
    try:
        path = fr / f"{proc.pid}.json"
        assert wait_for(lambda: path.exists(), timeout=60), proc.stderr.read() if proc.poll() is not None else ""
        s = json.loads(path.read_text())
        assert s["rank"] == 3 and s["pid"] == proc.pid and s["entered"] == 5 and not s["in_collective"]
        assert [e["collective_seq_id"] for e in s["entries"]] == [3, 4, 5]
        assert {e["profiling_name"] for e in s["entries"]} == {"gloo:all_reduce"}
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_hook_stays_idle_without_torch_and_runs_the_sitecustomize_it_shadows(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.SHADOWED_RAN = True\n")
    code = ("import sys, time, builtins\ntime.sleep(0.8)\n"
            "print(getattr(builtins, 'SHADOWED_RAN', False), 'torch' in sys.modules, "
            "'_stalwart_frhook' in sys.modules)")
    proc, fr = run_hooked(tmp_path, code, extra_path=other)
    out, err = proc.communicate(timeout=30)
    assert out.split() == ["True", "False", "True"], err
    assert os.listdir(fr) == []
    # switched off by the job: period 0
    proc, fr = run_hooked(tmp_path, "import sys; print('_stalwart_frhook' in sys.modules)",
                          env={p.Env.FR_PERIOD: "0"})
    assert proc.communicate(timeout=30)[0].strip() == "True"


def test_progress_watch_on_real_workers(tmp_path):
    """CPU outside a collective is progress, CPU inside one is not, a sleeping worker shows none;
    collective counts go out only for workers without the SDK, and only when they grew."""
    busy = "import time\nwhile True:\n    sum(range(10000))\n"
    workers = WorkerSet(str(tmp_path / "logs"), lambda w: None)
    fr = tmp_path / "fr"
    workers.spawn([sys.executable, "-c", busy], [dict(os.environ)] * 2, [0, 1], 1, None, "run1")
    asleep = tmp_path / "asleep"
    sleeper = "import pathlib, sys, time\npathlib.Path(sys.argv[1]).touch()\ntime.sleep(60)\n"
    workers.spawn([sys.executable, "-c", sleeper, str(asleep)], [dict(os.environ)], [2], 1, None, "run1")
    deadline = time.monotonic() + 30       # the sleeper's start-up (imports) is CPU, not yet its sleep
    while not asleep.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert asleep.exists()
    time.sleep(0.2)
    events = []
    watch = ProgressWatch(str(fr), lambda: list(workers.workers), lambda pid: False, lambda: {}, lambda: 1,
                          events.append, period_s=0.5)
    try:
        pids = {w.rank: w.proc.pid for w in workers.workers}
        inside = {"entered": 4, "in_collective": True, "entries": [], "t": time.time()}
        (fr / f"{pids[1]}.json").write_text(json.dumps(inside))       # rank 1 "spins inside a collective"
        first = watch.sample(time.time())
        assert first is not None and first.ranks == [0, 1, 2] and first.collectives == {1: 4}  # first samples
        time.sleep(1.0)
        second = watch.sample(time.time())
        assert isinstance(second, p.Activity) and second.run == 1
        assert second.ranks == [0] and second.collectives == {}                  # nothing new to send
        (fr / f"{pids[1]}.json").write_text(json.dumps(dict(inside, entered=5)))
        time.sleep(0.5)
        third = watch.sample(time.time())
        assert third is not None and third.ranks == [0, 1] and third.collectives == {1: 5}
        assert set(watch.summaries({1: {pids[1]}, 0: {pids[0]}})) == {1}
        watch.reset()
        assert os.listdir(fr) == []
    finally:
        workers.stop()
