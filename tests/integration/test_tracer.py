"""Real stack capture (py-spy) of running, SIGSTOP-ed and cgroup-frozen process trees, and a
real flight-recorder dump from a rank blocked in a gloo all_reduce."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from stalwart.agent import tracer
from stalwart.analyzer.flightrec import laggards
from stalwart.analyzer.stacks import aggregate, from_pyspy, normalize
from stalwart.worker import frdump

PY_SPY_MISSING = None
try:
    tracer.find_pyspy()
except FileNotFoundError as e:
    PY_SPY_MISSING = str(e)
needs_pyspy = pytest.mark.skipif(PY_SPY_MISSING is not None, reason=PY_SPY_MISSING or "")

# A "worker": a main thread parked in a named function, plus one child process named like
# a checkpoint helper and (optionally) a grandchild.  No torch import: keeps the test light.
WORKER = r'''
import multiprocessing as mp, sys, time
def ckpt_persist_loop():
    print("helper ready", flush=True)
    time.sleep(120)
def all_reduce_wait():
    time.sleep(120)
def recv_backward():
    time.sleep(120)
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    kids = [ctx.Process(target=ckpt_persist_loop, name="ckpt") for _ in range(int(sys.argv[2]))]
    for k in kids:
        k.start()
    print("ready", flush=True)
    (recv_backward if sys.argv[1] == "stuck" else all_reduce_wait)()
'''


@pytest.fixture
def workers(tmp_path):
    """Start worker processes; every one and its whole tree is killed at the end."""
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    procs = []

    def start(mode="ok", children=0):
        p = subprocess.Popen([sys.executable, str(script), mode, str(children)],
                             stdout=subprocess.PIPE, text=True, cwd=tmp_path)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"    # bounded by the test timeout
        for _ in range(children):                # each helper says when it is in its loop
            assert p.stdout.readline().strip() == "helper ready"
        return p

    try:
        yield start
    finally:
        for p in procs:
            try:
                tree = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                tree = []
            for q in [p] + tree:
                try:
                    os.kill(q.pid, signal.SIGCONT)
                    os.kill(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(10)
            p.stdout.close()
            psutil.wait_procs(tree, timeout=10)


def test_role_of_and_missing_pyspy(monkeypatch, tmp_path):
    assert tracer.role_of("python", ["python", "train.py"], True) == "worker"
    assert tracer.role_of("pt_data_worker", ["python", "train.py"], False) == "dataloader"
    assert tracer.role_of("python", ["python", "-c", "from multiprocessing... ckpt"], False) == "ckpt"
    assert tracer.role_of("python", ["python", "helper.py"], False) == "child"
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="py-spy not found"):
        tracer.find_pyspy()
    with pytest.raises(ValueError):
        tracer.capture({0: -5})


@needs_pyspy
@pytest.mark.timeout(90)
def test_capture_four_workers_with_children_in_parallel(workers):
    procs = [workers("stuck" if r == 2 else "ok", children=1) for r in range(4)]
    t0 = time.monotonic()
    recs = tracer.capture({r: p.pid for r, p in enumerate(procs)}, timeout_s=5.0, machine="m-7")
    elapsed = time.monotonic() - t0
    print(f"capture of 4 workers + 8 children: {elapsed:.3f} s")
    assert elapsed < 5.0
    # per worker: itself, its spawned helper and multiprocessing's resource tracker
    assert len(recs) == 12 and all(r["error"] is None for r in recs), recs
    assert [r["rank"] for r in recs if r["role"] == "worker"] == [0, 1, 2, 3]
    kids = [r for r in recs if r["role"] != "worker"]
    assert sorted(r["rank"] for r in kids) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(r["machine"] == "m-7" and r["threads"] for r in recs)
    stacks = [from_pyspy(r["threads"], r["rank"], 0, r["role"]) for r in recs]
    assert normalize(stacks[0]).endswith("train:all_reduce_wait")
    assert normalize(next(s for s in stacks if s.rank == 2 and s.role == "worker")
                     ).endswith("train:recv_backward")
    assert sum("ckpt_persist_loop" in normalize(s) for s in stacks if s.role != "worker") == 4
    assert aggregate(stacks).outliers == [2]
    # the same records through the controller's glue, as if each rank were its own machine
    from stalwart.controller.rules.hangstacks import decide_hang
    from stalwart.topology import Topology
    by_machine = {}
    for r in recs:
        by_machine.setdefault(f"m{r['rank']}", []).append(r)
    d = decide_hang(by_machine, Topology(machines=4, gpus_per_machine=1, dp=4), ["m0", "m1", "m2", "m3"])
    assert d.outlier_ranks == [2] and d.machines == ["m2"] and d.kind == "machines"


@needs_pyspy
@pytest.mark.timeout(60)
def test_capture_sigstopped_worker(workers):
    p = workers("stuck", children=1)
    os.kill(p.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(p.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "SIGSTOP did not take effect"
            time.sleep(0.01)
        t0 = time.monotonic()
        recs = tracer.capture({5: p.pid}, timeout_s=5.0)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(p.pid, signal.SIGCONT)
    worker = next(r for r in recs if r["role"] == "worker")
    assert worker["error"] is None and elapsed < 5.0
    assert normalize(from_pyspy(worker["threads"], 5, 0)).endswith("train:recv_backward")


@needs_pyspy
@pytest.mark.timeout(60)
def test_dead_pid_gives_an_error_record_not_an_exception(workers):
    p = workers()
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    recs = tracer.capture({0: p.pid}, timeout_s=2.0)
    assert len(recs) == 1 and recs[0]["threads"] == []
    assert recs[0]["error"] in ("process does not exist", "process exited during capture") \
        or recs[0]["error"].startswith("py-spy exit")


@needs_pyspy
@pytest.mark.root
@pytest.mark.timeout(90)
def test_capture_cgroup_frozen_worker(workers):
    if os.geteuid() != 0:
        pytest.skip("freezing a process needs root")
    from stalwart.chaos.cgroup import CgroupChaos
    chaos = CgroupChaos(f"tracer-test-{os.getpid()}")
    ok, why = chaos.available()
    if not ok:
        pytest.skip(f"cgroup freezer unavailable: {why}")
    p = workers("stuck", children=1)
    tree = [p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    try:
        chaos.freeze(tree)
        assert chaos.frozen
        t0 = time.monotonic()
        recs = tracer.capture({3: p.pid}, timeout_s=5.0)
        elapsed = time.monotonic() - t0
        assert chaos.frozen                         # the capture did not thaw anything
    finally:
        chaos.destroy()
    print(f"capture of a frozen worker + 2 children: {elapsed:.3f} s")
    assert len(recs) == 3 and all(r["error"] is None for r in recs), recs  # + resource tracker
    worker = next(r for r in recs if r["role"] == "worker")
    assert normalize(from_pyspy(worker["threads"], 3, 0)).endswith("train:recv_backward")


# ------------------------------------------------------------------ flight recorder
FR_RANK = r'''
import datetime, json, os, sys, threading, time
from stalwart.worker import frdump
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
frdump.enable()
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=90))
os.environ.pop(frdump.ENV)
try:
    frdump.enable()
    late = "no error"
except RuntimeError as e:
    late = str(e)
t = torch.ones(4)
for _ in range(2):
    dist.all_reduce(t)

before = max(e["record_id"] for e in frdump.dump()["entries"])

def side():
    # rank 0: dump once the all_reduce after the loop shows up unfinished;
    # rank 1: once its loop's entries are all marked retired (gloo marks them shortly after)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        trace = frdump.dump()
        took = time.perf_counter() - t0
        new = [e for e in trace["entries"] if e["record_id"] > before and not e["retired"]]
        if (new if rank == 0 else all(e["retired"] for e in trace["entries"])):
            with open(out + ".tmp", "w") as f:
                json.dump({"trace": trace, "took_s": took, "late": late}, f)
            os.rename(out + ".tmp", out)
            return
        time.sleep(0.02)

threading.Thread(target=side, daemon=True).start()
if rank == 0:
    dist.all_reduce(t)          # rank 1 never enters: blocks here
time.sleep(90)
'''


def test_enable_sets_the_buffer_only_when_unset(monkeypatch):
    monkeypatch.delenv(frdump.ENV, raising=False)
    assert frdump.enable(123) == 123 and os.environ[frdump.ENV] == "123"
    monkeypatch.setenv(frdump.ENV, "77")
    assert frdump.enable() == 77
    monkeypatch.setenv(frdump.ENV, "x")
    with pytest.raises(ValueError):
        frdump.enable()
    with pytest.raises(ValueError):
        frdump.enable(0)


@pytest.mark.timeout(120)
def test_dump_from_a_side_thread_of_a_rank_blocked_in_all_reduce(tmp_path):
    script = tmp_path / "fr_rank.py"
    script.write_text(FR_RANK)
    env = {k: v for k, v in os.environ.items() if k != frdump.ENV}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "src")]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    outs = [tmp_path / f"fr{r}.json" for r in range(2)]
    procs = []
    try:
        for r in range(2):
            procs.append(subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"),
                                           str(outs[r])], env=env, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 90
        while not all(o.exists() for o in outs):
            for p in procs:
                if p.poll() is not None:
                    raise AssertionError(f"rank exited {p.returncode}: {p.stderr.read()[-2000:]}")
            assert time.monotonic() < deadline, "no flight-recorder dump within 90 s"
            time.sleep(0.1)
        assert procs[0].poll() is None          # rank 0 is still blocked in all_reduce
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
            p.stderr.close()
    got = [json.loads(o.read_text()) for o in outs]
    print(f"flight-recorder dump in the blocked rank took {got[0]['took_s'] * 1e3:.2f} ms")
    assert got[0]["took_s"] < 0.5
    assert "too late" in got[0]["late"]
    entries = got[0]["trace"]["entries"]
    pending = [e for e in entries if not e["retired"]]
    assert len(pending) == 1 and "all_reduce" in pending[0]["profiling_name"]
    rank1_last = max(e["collective_seq_id"] for e in got[1]["trace"]["entries"])
    assert pending[0]["collective_seq_id"] == rank1_last + 1     # the one rank 1 never entered
    lags = laggards({r: g["trace"] for r, g in enumerate(got)})
    assert [g.laggards for g in lags.values()] == [[1]]
    assert [g.waiting for g in lags.values()] == [[0]]
