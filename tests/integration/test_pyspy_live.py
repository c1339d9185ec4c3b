"""Stacks of real processes dumped with py-spy, grouped by the analyzer."""
import pathlib
import subprocess
import sys

import pytest

from stalwart.analyzer.stacks import aggregate, decide_eviction, from_pyspy, normalize
from stalwart.topology import Topology

LIVE_SCRIPT = '''
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
def grad_sync(): time.sleep(60)
def recv_backward(): time.sleep(60)
def step(stuck):
    recv_backward() if stuck else grad_sync()
pool = ThreadPoolExecutor(2)
pool.submit(int).result()
def fr_dump():                      # busy, like the SDK's flight-recorder thread mid-dump
    while True:
        sum(range(10000))
if sys.argv[2:] == ["fr"]:
    threading.Thread(target=fr_dump, name="stalwart-fr", daemon=True).start()
print("ready", flush=True)
step(sys.argv[1] == "1")
'''


@pytest.mark.timeout(60)
def test_live_py_spy_dumps_aggregate_to_the_stuck_process(tmp_path):
    """Three real processes (one stuck elsewhere; a healthy one with a busy thread of the SDK's,
    which the key leaves out), dumped with py-spy --json --nonblocking."""
    pyspy = pathlib.Path(sys.executable).parent / "py-spy"
    if not pyspy.exists():
        pytest.skip("py-spy is not installed next to the interpreter")
    script = tmp_path / "train_job.py"
    script.write_text(LIVE_SCRIPT)
    procs = []
    try:
        for args in (["0"], ["1"], ["0", "fr"]):
            procs.append(subprocess.Popen([sys.executable, str(script), *args],
                                          stdout=subprocess.PIPE, text=True))
        for p in procs:
            assert p.stdout.readline().strip() == "ready"  # bounded by the test timeout
        stacks = []
        for rank, p in enumerate(procs):
            dump = subprocess.run([str(pyspy), "dump", "--json", "--nonblocking", "--pid", str(p.pid)],
                                  capture_output=True, text=True, timeout=20)
            if dump.returncode != 0:
                pytest.skip(f"py-spy cannot attach here: {dump.stderr.strip()[:200]}")
            stacks.append(from_pyspy(dump.stdout, rank=rank, machine=rank))
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
            p.stdout.close()
    assert normalize(stacks[1]) == "main: train_job:<module> > train_job:step > train_job:recv_backward"
    agg = aggregate(stacks)
    assert agg.outliers == [1] and agg.healthy == [0, 2]
    d = decide_eviction(agg, Topology(machines=3, gpus_per_machine=1, dp=3))
    assert (d.kind, d.machines) == ("machines", [1])  # the dp group is the whole job
    assert "dp group of 3 of 3 machines" in d.reason
