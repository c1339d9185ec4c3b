"""decide_hang: tracer records -> eviction, on synthetic py-spy output (tracer record format)."""

import json
import pathlib

import pytest

from stalwart.controller.rules.hangstacks import Decision, decide_hang, to_process_stacks
from stalwart.topology import KINDS, Topology

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "stacks"
SITE = "/opt/venv/lib/python3.11/site-packages/"

GRAD_SYNC = [("train.py", "<module>"), ("train.py", "train_step"),
             ("torch/distributed/distributed_c10d.py", "all_reduce")]
RECV = [("train.py", "<module>"), ("train.py", "train_step"), ("pipeline.py", "recv_backward"),
        ("torch/distributed/distributed_c10d.py", "recv")]
LOADER = [("torch/utils/data/_utils/worker.py", "_worker_loop"),
          ("multiprocessing/queues.py", "Queue.get")]
LOADER_STUCK = [("torch/utils/data/_utils/worker.py", "_worker_loop"),
                ("dataset.py", "Dataset.__getitem__"), ("dataset.py", "read_shard")]


def threads(outer_to_inner, pid, variant):
    """py-spy JSON of a one-thread process; paths and lines vary per rank like on a cluster."""
    frames = []
    for i, (short, name) in enumerate(outer_to_inner):
        path = (SITE + short) if short.startswith("torch/") else (
            "/usr/lib/python3.11/" + short if short.startswith("multiprocessing") else
            f"/home/u{variant}/{short}")
        frames.append({"name": name, "filename": path, "module": None, "short_filename": short,
                       "line": 10 + i + variant, "locals": None, "is_entry": False,
                       "is_shim_entry": False})
    return [{"pid": pid, "thread_id": 7000 + pid, "thread_name": "MainThread", "os_thread_id": pid,
             "active": False, "owns_gil": False, "frames": frames[::-1], "process_info": None}]


def ids(topo):
    return [f"node-{i:02d}" for i in range(topo.machines)]


def capture(topo, stack_of, loader_of=None):
    """What every machine's tracer returns: worker + one data-loader child per rank."""
    out = {}
    names = ids(topo)
    for r in range(topo.world_size):
        m = topo.machine_of(r)
        pid = 4000 + 10 * r
        recs = out.setdefault(names[m], [])
        recs.append({"rank": r, "pid": pid, "role": "worker", "machine": names[m],
                     "threads": threads(stack_of(r), pid, r), "error": None})
        recs.append({"rank": r, "pid": pid + 1, "role": "dataloader", "machine": names[m],
                     "threads": threads((loader_of or (lambda _: LOADER))(r), pid + 1, r),
                     "error": None})
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_every_parallel_dimension(kind):
    topo = Topology(machines=16, gpus_per_machine=2, tp=2, pp=2, dp=2, cp=2, ep=2)
    bad = set(topo.group(kind, 5))
    d = decide_hang(capture(topo, lambda r: RECV if r in bad else GRAD_SYNC), topo, ids(topo))
    want = topo.machines_of(bad)
    assert d.kind == kind and d.machine_indices == want
    assert d.machines == [f"node-{i:02d}" for i in want]
    assert d.outlier_ranks == sorted(bad) and d.source == "stacks"


def test_all_identical_evicts_nothing():
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=2)
    d = decide_hang(capture(topo, lambda r: GRAD_SYNC), topo, ids(topo))
    assert d == Decision(None, [], [], d.reason, None, [], [])
    assert "all 8 ranks show the same stack" in d.reason


def test_fig7_backward_hang_via_the_glue():
    """The paper's Fig. 7: TP=2 PP=4 DP=4 on 16 machines; the stuck pipeline is evicted."""
    topo = Topology(machines=16, gpus_per_machine=2, tp=2, pp=4, dp=4)
    rows = json.loads((FIXTURES / "fig7_pyspy.json").read_text())
    names = [f"host-{i}" for i in range(16)]
    names[7] = "standby-2"                          # a standby took index 7 earlier
    by_machine = {}
    for row in rows:
        by_machine.setdefault(names[row["machine"]], []).append(dict(row, error=None))
    d = decide_hang(by_machine, topo, names)
    # the stuck pipeline is dp=3 (the paper draws it as machines 12-15; with the rank order
    # tp-cp-ep-dp-pp its four stages sit on machines 3, 7, 11, 15)
    assert d.kind == "pp" and d.machine_indices == [3, 7, 11, 15]
    assert d.machines == ["host-3", "standby-2", "host-11", "host-15"]
    assert d.outlier_ranks == [6, 7, 14, 15, 22, 23, 30, 31]


def test_stuck_dataloader_child_points_at_its_rank():
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=1, dp=4)
    d = decide_hang(capture(topo, lambda r: GRAD_SYNC,
                            lambda r: LOADER_STUCK if r == 5 else LOADER), topo, ids(topo))
    assert d.outlier_ranks == [5] and d.kind == "tp" and d.machines == ["node-02"]


def test_silent_machine_and_failed_worker_capture_are_outliers():
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=1, dp=4)
    cap = capture(topo, lambda r: GRAD_SYNC)
    del cap["node-03"]                              # its agent did not answer
    d = decide_hang(cap, topo, ids(topo))
    assert d.machines == ["node-03"] and d.not_captured == [6, 7] and "without a captured" in d.reason
    cap = capture(topo, lambda r: GRAD_SYNC)
    for rec in cap["node-01"]:
        if rec["rank"] == 2:
            rec.update(threads=[], error="py-spy timed out after 5 s")
    d = decide_hang(cap, topo, ids(topo))
    assert d.outlier_ranks == [2] and d.machines == ["node-01"] and d.not_captured == [2]


def test_vanished_child_is_ignored():
    topo = Topology(machines=2, gpus_per_machine=1, dp=2)
    cap = capture(topo, lambda r: GRAD_SYNC)
    cap["node-01"].append({"rank": 1, "pid": 99, "role": "child", "machine": "node-01",
                           "threads": [], "error": "process exited during capture"})
    d = decide_hang(cap, topo, ids(topo))
    assert d.kind is None and d.outlier_ranks == []
    stacks, absent = to_process_stacks(cap, topo, ids(topo))
    assert len(stacks) == 4 and absent == []


def _fr(entries):
    return {"entries": [dict(pg_id="0", process_group=["0", "default_pg"], p2p_seq_id=0, is_p2p=False,
                             record_id=i, **e) for i, e in enumerate(entries)]}


def _ar(seq, retired=True):
    return {"collective_seq_id": seq, "profiling_name": "gloo:all_reduce", "retired": retired}


def test_flight_recorder_names_the_laggard_when_stacks_split_evenly():
    """dp=4 on 4 machines: two ranks in all_reduce, two in recv (2 vs 2: both groups count as
    healthy, no outlier); the flight recorder shows rank 3 never entered all_reduce #6."""
    topo = Topology(machines=4, gpus_per_machine=1, dp=4)
    cap = capture(topo, lambda r: GRAD_SYNC if r < 2 else RECV)
    assert decide_hang(cap, topo, ids(topo)).kind is None
    dumps = {r: _fr([_ar(s) for s in range(1, 6)] + [_ar(6, retired=False)]) for r in range(3)}
    dumps[3] = _fr([_ar(s) for s in range(1, 6)])
    d = decide_hang(cap, topo, ids(topo), fr_dumps=dumps)
    assert d.source == "flightrec" and d.outlier_ranks == [3] and d.machines == ["node-03"]
    assert "ranks [3] never entered gloo:all_reduce #6" in d.reason


def test_flight_recorder_resolves_ambiguous_stacks():
    """8 ranks, stacks A A B B C D E F: no group holds a majority (ambiguous)."""
    topo = Topology(machines=8, gpus_per_machine=1, dp=8)
    kinds = [0, 0, 1, 1, 2, 3, 4, 5]
    cap = capture(topo, lambda r: GRAD_SYNC + [("train.py", f"phase{kinds[r]}")])
    assert "ambiguous" in decide_hang(cap, topo, ids(topo)).reason
    dumps = {r: _fr([_ar(1), _ar(2, retired=False)]) for r in range(7)}
    dumps[7] = _fr([_ar(1)])
    d = decide_hang(cap, topo, ids(topo), fr_dumps=dumps)
    assert d.source == "flightrec" and d.machines == ["node-07"] and d.kind == "machines"
    assert d.reason.startswith("stacks inconclusive (ambiguous")


def test_flight_recorder_when_all_stacks_agree_and_when_it_agrees_too():
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=2)
    cap = capture(topo, lambda r: GRAD_SYNC)
    dumps = {r: _fr([_ar(1), _ar(2, retired=(r == 4))]) for r in range(8)}
    dumps[4] = _fr([_ar(1)])                         # rank 4 never entered #2
    d = decide_hang(cap, topo, ids(topo), fr_dumps=dumps)
    assert d.outlier_ranks == [4] and d.kind == "tp" and d.machines == ["node-02"]
    healthy = {r: _fr([_ar(1), _ar(2)]) for r in range(8)}
    d2 = decide_hang(cap, topo, ids(topo), fr_dumps=healthy)
    assert d2.kind is None and d2.machines == [] and "same collectives" in d2.reason


def test_flight_recorder_when_the_stack_outliers_narrow_nothing():
    """tp 2 x dp 3 on 3 machines: the hung rank 0 sleeps outside any collective, and the capture
    caught rank 2 (another machine) in a different frame: outliers on machines 0 and 1 share only
    the dp group of the whole job. The flight recorder shows ranks 0 and 1 never entered the
    all_reduce the others wait in: machine 0, not a guess over the whole job."""
    topo = Topology(machines=3, gpus_per_machine=2, tp=2, dp=3)
    sleep = [("train.py", "<module>"), ("train.py", "train_step"), ("stalwart/worker.py", "maybe_hang")]
    cap = capture(topo, lambda r: sleep if r == 0 else RECV if r == 2 else GRAD_SYNC)
    alone = decide_hang(cap, topo, ids(topo))
    assert alone.machines == [] and "narrow nothing" in alone.reason
    dumps = {r: _fr([_ar(1), _ar(2, retired=False)]) for r in range(6)}
    dumps[0] = dumps[1] = _fr([_ar(1)])
    d = decide_hang(cap, topo, ids(topo), fr_dumps=dumps)
    assert d.source == "flightrec" and d.outlier_ranks == [0, 1] and d.machines == ["node-00"]
    assert d.reason.startswith("stacks inconclusive (outliers on 2 machines")
    # a recorder that shows every rank in the same collective changes nothing
    same = {r: _fr([_ar(1), _ar(2, retired=False)]) for r in range(6)}
    d2 = decide_hang(cap, topo, ids(topo), fr_dumps=same)
    assert d2.machines == [] and "narrow nothing" in d2.reason


def test_bad_input_is_refused():
    topo = Topology(machines=2, gpus_per_machine=1, dp=2)
    cap = capture(topo, lambda r: GRAD_SYNC)
    with pytest.raises(ValueError, match="unknown machine"):
        decide_hang({"elsewhere": cap["node-00"]}, topo, ids(topo))
    with pytest.raises(ValueError, match="places on index"):
        decide_hang({"node-01": cap["node-00"]}, topo, ids(topo))
    with pytest.raises(ValueError, match="no id for topology machine"):
        decide_hang(cap, topo, ["node-00"])
    with pytest.raises(ValueError, match="at least one machine"):
        decide_hang({}, topo, ids(topo))
    d = decide_hang(cap, topo, {0: "node-00", 1: "node-01"})
    assert d.kind is None
