"""Stack aggregation and over-eviction: real py-spy dumps, Fig. 7, every parallel kind.

The first part synthesizes py-spy ``dump --json`` output for training processes; its
thread/frame layout copies the real dumps recorded in fixtures/stacks/pyspy_*.json,
and paths, line numbers, pids and thread ids vary per rank like they do on a cluster.
"""

import json
import pathlib

import pytest

from stalwart.analyzer.stacks import (Aggregation, ProcessStack, aggregate, decide_eviction,
                                      from_pyspy, normalize, rank_keys)
from stalwart.topology import Topology
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "stacks"
PREFIXES = ["/usr/local/lib/python3.11/site-packages/", "/opt/venv/lib/python3.11/site-packages/"]
STDLIB = "/usr/lib/python3.11/"

SPAWN = [("<string>", "<module>"), ("multiprocessing/spawn.py", "spawn_main"),
         ("multiprocessing/spawn.py", "_main"), ("multiprocessing/process.py", "BaseProcess._bootstrap"),
         ("multiprocessing/process.py", "BaseProcess.run")]
TRAIN = [("pretrain_gpt.py", "<module>"), ("megatron/training/training.py", "pretrain"),
         ("megatron/training/training.py", "train"), ("megatron/training/training.py", "train_step")]
WRAP = ("torch/distributed/c10d_logger.py", "_exception_logger.<locals>.wrapper")
GRAD_SYNC = TRAIN + [
    ("megatron/core/optimizer/distrib_optimizer.py", "DistributedOptimizer.step"),
    ("megatron/core/distributed/param_and_grad_buffer.py", "_ParamAndGradBucketGroup.finish_grad_sync"),
    WRAP, ("torch/distributed/distributed_c10d.py", "reduce_scatter_tensor")]
_PIPE = TRAIN + [("megatron/core/pipeline_parallel/schedules.py",
                  "forward_backward_pipelining_without_interleaving")]
BWD_ALLGATHER = _PIPE + [
    ("megatron/core/pipeline_parallel/schedules.py", "backward_step"),
    ("torch/autograd/__init__.py", "backward"), ("torch/autograd/graph.py", "_engine_run_backward"),
    ("torch/autograd/function.py", "BackwardCFunction.apply"),
    ("megatron/core/tensor_parallel/mappings.py", "_ReduceScatterToSequenceParallelRegion.backward"),
    ("megatron/core/tensor_parallel/mappings.py", "_gather_along_first_dim"),
    WRAP, ("torch/distributed/distributed_c10d.py", "all_gather_into_tensor")]
_P2P = [("megatron/core/pipeline_parallel/p2p_communication.py", "_communicate"),
        ("megatron/core/pipeline_parallel/p2p_communication.py", "_p2p_ops")]
RECV_BWD = _PIPE + [("megatron/core/pipeline_parallel/p2p_communication.py", "recv_backward")] + _P2P + [
    WRAP, ("torch/distributed/distributed_c10d.py", "irecv")]
SEND_BWD = _PIPE + [("megatron/core/pipeline_parallel/p2p_communication.py", "send_backward")] + _P2P + [
    WRAP, ("torch/distributed/distributed_c10d.py", "isend")]
DATALOADER_IDLE = SPAWN + [("torch/utils/data/_utils/worker.py", "_worker_loop"),
                           ("multiprocessing/queues.py", "Queue.get"),
                           ("multiprocessing/connection.py", "_ConnectionBase.poll"),
                           ("multiprocessing/connection.py", "Connection._poll"),
                           ("multiprocessing/connection.py", "wait"),
                           ("selectors.py", "_PollLikeSelector.select")]
DATALOADER_STUCK = SPAWN + [("torch/utils/data/_utils/worker.py", "_worker_loop"),
                            ("torch/utils/data/_utils/fetch.py", "_MapDatasetFetcher.fetch"),
                            ("megatron/core/datasets/gpt_dataset.py", "GPTDataset.__getitem__"),
                            ("megatron/core/datasets/indexed_dataset.py", "_MMapBinReader.read")]
CKPT_WRITE = SPAWN + [("stalwart/agent/ckpt.py", "persist_loop"), ("torch/serialization.py", "save"),
                      ("torch/serialization.py", "_save")]


def _template(name):
    return json.loads((FIXTURES / name).read_text())


def _frame(short, name, line, variant):
    if short.startswith("<"):
        filename = short
    elif short.split("/")[0] in ("multiprocessing", "selectors.py", "threading.py", "socket.py"):
        filename = STDLIB + short
    elif short.split("/")[0] in ("torch", "megatron", "stalwart"):
        filename = PREFIXES[variant % len(PREFIXES)] + short
    else:
        filename = f"/home/job{variant}/{short}"
    return {"name": name, "filename": filename, "module": None, "short_filename": short,
            "line": line, "locals": None, "is_entry": False, "is_shim_entry": False}


def thread(outer_to_inner, pid, tid, name="MainThread", variant=0):
    """One py-spy thread object; frames given outermost first (py-spy stores innermost first)."""
    frames = [_frame(s, n, 10 + 7 * i + variant, variant) for i, (s, n) in enumerate(outer_to_inner)]
    return {"pid": pid, "thread_id": 139900000000000 + tid, "thread_name": name,
            "os_thread_id": tid, "active": False, "owns_gil": False,
            "frames": list(reversed(frames)), "process_info": None}


def process(outer_to_inner, pid, variant=0, feeder=True):
    """py-spy JSON of one process: its main thread plus an idle queue-feeder thread."""
    threads = []
    if feeder:
        feed = _template("pyspy_rank0_worker.json")[0]  # the real QueueFeederThread
        threads.append(dict(feed, pid=pid, os_thread_id=pid + 61, thread_id=feed["thread_id"] + pid))
    threads.append(thread(outer_to_inner, pid, pid, variant=variant))
    return threads


def job_stacks(topo, stack_of, dataloader=True, helpers=()):
    """ProcessStacks for every rank: worker (stack_of(rank)) and one idle data-loader child."""
    out = []
    for rank in range(topo.world_size):
        m = topo.machine_of(rank)
        pid = 1000 + 37 * rank
        out.append(ProcessStack(rank, pid, "worker", m, process(stack_of(rank), pid, variant=rank)))
        if dataloader:
            out.append(ProcessStack(rank, pid + 1, "dataloader", m,
                                    process(DATALOADER_IDLE, pid + 1, variant=rank)))
    return out + list(helpers)


def fig7_topology():
    return Topology(machines=16, gpus_per_machine=2, tp=2, pp=4, dp=4)


def fig7_stack(topo):
    """Pipeline dp=3 hangs in backward; every other rank waits in the optimizer's grad sync."""
    def stack_of(rank):
        c = topo.coords(rank)
        if c["dp"] != 3:
            return GRAD_SYNC
        return {3: BWD_ALLGATHER, 2: SEND_BWD}.get(c["pp"], RECV_BWD)
    return stack_of


def write_fig7_fixture():
    """Store the synthesized Fig. 7 capture (what the agents would send) as a fixture."""
    topo = fig7_topology()
    rows = [{"rank": p.rank, "pid": p.pid, "role": p.role, "machine": p.machine, "threads": p.threads}
            for p in job_stacks(topo, fig7_stack(topo))]
    (FIXTURES / "fig7_pyspy.json").write_text(json.dumps(rows, indent=1) + "\n")


def load_fig7():
    rows = json.loads((FIXTURES / "fig7_pyspy.json").read_text())
    return [ProcessStack(**r) for r in rows]


# ---------------------------------------------------------------- normalize
def test_normalize_real_worker_blocked_in_all_reduce():
    ps = from_pyspy((FIXTURES / "pyspy_rank0_worker.json").read_text(), rank=0, machine=0)
    text = normalize(ps)
    assert "\n" not in text  # the idle QueueFeederThread is dropped
    assert text.startswith("main: <string>:<module> > multiprocessing.spawn:spawn_main")
    assert text.endswith("rec_stacks:optimizer_step > "
                         "torch.distributed.c10d_logger:_exception_logger.<locals>.wrapper > "
                         "torch.distributed.distributed_c10d:all_reduce")
    assert "/" not in text and ".py" not in text and str(ps.pid) not in text


def test_normalize_real_dataloader_and_rank_difference():
    dl = from_pyspy((FIXTURES / "pyspy_rank0_dataloader.json").read_text(), 0, 0, "dataloader")
    dl1 = from_pyspy((FIXTURES / "pyspy_rank1_dataloader.json").read_text(), 1, 0, "dataloader")
    assert normalize(dl) == normalize(dl1)  # different pids, same canonical stack
    assert "torch.utils.data._utils.worker:_worker_loop" in normalize(dl)
    assert "resource_sharer" not in normalize(dl) and "Queue._feed" not in normalize(dl)
    w1 = from_pyspy((FIXTURES / "pyspy_rank1_worker.json").read_text(), 1, 0)
    assert normalize(w1).endswith("rec_stacks:train > rec_stacks:slow_compute")


def test_normalize_ignores_lines_paths_and_frozen_frames_keeps_user_threads():
    a = ProcessStack(0, 11, "worker", 0, process(GRAD_SYNC, 11, variant=0))
    b = ProcessStack(5, 99, "worker", 2, process(GRAD_SYNC, 99, variant=5))
    assert normalize(a) == normalize(b)
    frozen = {"name": "_call_with_frames_removed", "filename": "<frozen importlib._bootstrap>",
              "short_filename": "<frozen importlib._bootstrap>", "module": None, "line": 241}
    b.threads[-1]["frames"].insert(0, frozen)
    assert normalize(a) == normalize(b)
    user = thread([("threading.py", "Thread._bootstrap"), ("threading.py", "Thread.run"),
                   ("stalwart/worker/ckpt.py", "copy_loop")], 99, 7, name="Thread-2 (copy_loop)")
    b.threads.append(user)
    assert normalize(b).splitlines()[1] == ("thread: threading:Thread._bootstrap > threading:Thread.run"
                                            " > stalwart.worker.ckpt:copy_loop")
    assert normalize(ProcessStack(0, 1, "worker", 0, [])) == "main: <no stack>"


def test_the_sdks_own_threads_are_left_out_of_the_key_wherever_they_are_caught():
    """Two healthy ranks whose flight-recorder dump (a `stalwart-*` thread on a timer of its own)
    is caught at two different places have one key: they belong in one group."""
    a = ProcessStack(0, 11, "worker", 0, process(GRAD_SYNC, 11, variant=0))
    b = ProcessStack(1, 99, "worker", 0, process(GRAD_SYNC, 99, variant=1))
    a.threads.append(thread([("threading.py", "Thread._bootstrap"), ("stalwart/worker/frhook.py", "_loop"),
                             ("threading.py", "Event.wait")], 11, 5, name="stalwart-fr"))
    b.threads.append(thread([("threading.py", "Thread._bootstrap"), ("stalwart/worker/frhook.py", "_loop"),
                             ("stalwart/worker/frhook.py", "_dump"), ("torch/distributed/fr.py", "dump")],
                            99, 5, name="stalwart-fr"))
    b.threads.append(thread([("threading.py", "Thread._bootstrap"), ("stalwart/worker/memckpt.py", "_commit")],
                            99, 6, name="stalwart-memckpt-r1_0"))
    assert normalize(a) == normalize(b)
    c = ProcessStack(2, 55, "worker", 1, process(GRAD_SYNC, 55, variant=2))
    assert aggregate([a, b, c]).outliers == []


def test_from_pyspy_refuses_bad_input():
    with pytest.raises(ValueError, match="not JSON"):
        from_pyspy("nope", 0, 0)
    with pytest.raises(ValueError, match="several processes"):
        from_pyspy(process(GRAD_SYNC, 1) + process(GRAD_SYNC, 2), 0, 0)
    with pytest.raises(ValueError, match="unknown process role"):
        ProcessStack(0, 1, "trainer", 0, [])


# ---------------------------------------------------------------- Fig. 7
def test_fig7_fixture_is_current():
    topo = fig7_topology()
    rows = [{"rank": p.rank, "pid": p.pid, "role": p.role, "machine": p.machine, "threads": p.threads}
            for p in job_stacks(topo, fig7_stack(topo))]
    assert json.loads((FIXTURES / "fig7_pyspy.json").read_text()) == rows


def test_fig7_hung_pipeline_is_over_evicted():
    topo = fig7_topology()
    agg = aggregate(load_fig7())
    assert not agg.ambiguous
    assert [len(r) for _, r in agg.groups] == [24, 4, 2, 2]
    assert "reduce_scatter_tensor" in agg.groups[0][0]
    assert agg.outliers == [6, 7, 14, 15, 22, 23, 30, 31]
    d = decide_eviction(agg, topo)
    assert (d.kind, d.machines) == ("pp", [3, 7, 11, 15])
    assert d.outlier_ranks == agg.outliers and "pp group" in d.reason


# ---------------------------------------------------------------- every kind
FULL = Topology(machines=32, gpus_per_machine=1, tp=2, cp=2, ep=2, dp=2, pp=2)


@pytest.mark.parametrize("kind", ["tp", "cp", "ep", "dp", "pp"])
def test_each_parallel_kind_is_found(kind):
    bad = set(FULL.group(kind, 21))
    stacks = job_stacks(FULL, lambda r: RECV_BWD if r in bad else GRAD_SYNC, dataloader=False)
    d = decide_eviction(aggregate(stacks), FULL)
    assert d.kind == kind and d.machines == FULL.machines_of(bad)


def test_one_outlier_rank_inside_a_machine_evicts_that_machine():
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=2)
    d = decide_eviction(aggregate(job_stacks(topo, lambda r: SEND_BWD if r == 5 else GRAD_SYNC)), topo)
    assert (d.kind, d.machines, d.outlier_ranks) == ("tp", [2], [5])


def test_several_outlier_groups_in_one_dp_group():
    topo = fig7_topology()  # machines 2 and 3 are pp stage 0 of replicas 2 and 3
    odd = {r: s for r, s in zip(topo.ranks_of_machine(2) + topo.ranks_of_machine(3),
                                [RECV_BWD, RECV_BWD, SEND_BWD, SEND_BWD])}
    agg = aggregate(job_stacks(topo, lambda r: odd.get(r, GRAD_SYNC)))
    assert len(agg.groups) == 3
    d = decide_eviction(agg, topo)
    assert (d.kind, d.machines) == ("dp", [0, 1, 2, 3])


def test_outliers_on_several_machines_without_a_narrow_group_narrow_nothing():
    topo = fig7_topology()
    odd = set(topo.ranks_of_machine(0) + topo.ranks_of_machine(5))  # (pp0, dp0) and (pp1, dp1)
    d = decide_eviction(aggregate(job_stacks(topo, lambda r: RECV_BWD if r in odd else GRAD_SYNC)), topo)
    assert d.kind is None and d.machines == [] and "narrow nothing" in d.reason
    assert d.outlier_ranks == sorted(odd)
    wide = {topo.ranks_of_machine(m)[0] for m in (0, 5, 10, 15, 1, 6, 11, 12, 2)}  # 9 of 16
    d = decide_eviction(aggregate(job_stacks(topo, lambda r: RECV_BWD if r in wide else GRAD_SYNC)), topo)
    assert d.kind is None and d.machines == [] and "not evicting" in d.reason


def test_outliers_on_two_machines_of_a_data_parallel_job_are_not_a_localization():
    """The issue's case: a slow link on m1 of a 4-machine DP job left ranks on m2 and m3 caught
    mid-step; their only shared group is the whole job: evict nothing (stop-time checks decide)."""
    topo = Topology(machines=8, gpus_per_machine=1, pp=1, dp=8)
    agg = aggregate(job_stacks(topo, lambda r: {2: RECV_BWD, 3: SEND_BWD}.get(r, GRAD_SYNC)))
    d = decide_eviction(agg, topo)
    assert agg.outliers == [2, 3] and (d.kind, d.machines) == (None, []) and "dp group of 8 of 8 machines" in d.reason
    # on 4 machines the two in the all-reduce are no majority: nobody is called healthy
    topo = Topology(machines=4, gpus_per_machine=1, pp=1, dp=4)
    agg = aggregate(job_stacks(topo, lambda r: {2: RECV_BWD, 3: SEND_BWD}.get(r, GRAD_SYNC)))
    assert agg.ambiguous and decide_eviction(agg, topo).machines == []


def test_a_plurality_that_is_no_majority_is_not_healthy():
    """The matrix's partition between the two machines of pipeline stage 0 (tp 2, pp 2, dp 2):
    stage 0's four ranks block in their data-parallel all-reduce (one stack), stage 1's four wait
    for them in two stacks of two. The four were taken for the healthy ones and stage 1's
    machines were over-evicted; half the ranks is no majority: ambiguous, and the flight recorder
    (which names the ranks that never entered the collective the others wait in) decides."""
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=2)
    agg = aggregate(job_stacks(topo, lambda r: GRAD_SYNC if r < 4 else (RECV_BWD if r % 2 else SEND_BWD)))
    assert [len(g) for _, g in agg.groups] == [4, 2, 2] and agg.ambiguous and agg.healthy == []
    d = decide_eviction(agg, topo)
    assert d.machines == [] and "ambiguous" in d.reason


def test_shared_group_larger_than_half_the_job_falls_back_to_outlier_machines():
    topo = Topology(machines=4, gpus_per_machine=1, pp=1, dp=4)
    agg = aggregate(job_stacks(topo, lambda r: RECV_BWD if r == 2 else GRAD_SYNC))
    assert (decide_eviction(agg, topo).kind, decide_eviction(agg, topo).machines) == ("machines", [2])
    assert decide_eviction(agg, topo, max_fraction=1.0).machines == [0, 1, 2, 3]


# ---------------------------------------------------------------- ties, identical
def test_all_identical_evicts_nothing():
    topo = fig7_topology()
    agg = aggregate(job_stacks(topo, lambda r: GRAD_SYNC))
    assert agg.outliers == [] and len(agg.groups) == 1
    d = decide_eviction(agg, topo)
    assert d.kind is None and d.machines == [] and "all 32 ranks" in d.reason


def test_equally_small_covering_groups_tie_break_by_kind_order():
    # rank 0 alone: its pp group {0, 2} and dp group {0, 1} both have 2 machines -> pp first
    topo = Topology(machines=4, gpus_per_machine=1, pp=2, dp=2)
    d = decide_eviction(aggregate(job_stacks(topo, lambda r: SEND_BWD if r == 0 else GRAD_SYNC)), topo)
    assert (d.kind, d.machines) == ("pp", [0, 2])
    topo = Topology(machines=8, gpus_per_machine=1, tp=2, cp=2, dp=2)  # tp {0,1} before cp {0,2}
    d = decide_eviction(aggregate(job_stacks(topo, lambda r: SEND_BWD if r == 0 else GRAD_SYNC)), topo)
    assert (d.kind, d.machines) == ("tp", [0, 1])


def test_tied_top_groups_covering_majority_are_all_healthy():
    topo = Topology(machines=8, gpus_per_machine=2, tp=2, pp=2, dp=4)
    # pp stage 0 waits in recv, stage 1 in grad sync: 8 + 8 ranks, a normal pipeline picture
    agg = aggregate(job_stacks(topo, lambda r: RECV_BWD if topo.coords(r)["pp"] == 0 else GRAD_SYNC))
    assert not agg.ambiguous and agg.outliers == [] and len(agg.healthy) == 16
    assert decide_eviction(agg, topo).machines == []
    # 7 + 7 tied and 2 odd ones: the tied groups cover 14 of 16 > half: the 2 are outliers
    stack = {0: SEND_BWD, 1: SEND_BWD}
    agg = aggregate(job_stacks(topo, lambda r: stack.get(r, RECV_BWD if r <= 8 else GRAD_SYNC)))
    assert [len(r) for _, r in agg.groups] == [7, 7, 2]
    assert agg.outliers == [0, 1] and decide_eviction(agg, topo).machines == [0]


def test_tied_top_groups_without_majority_are_ambiguous():
    topo = Topology(machines=8, gpus_per_machine=2, tp=2, pp=2, dp=4)
    kinds = [GRAD_SYNC, RECV_BWD, SEND_BWD, BWD_ALLGATHER, DATALOADER_STUCK]
    stack_of = {r: kinds[0] if r < 3 else kinds[1] if r < 6 else
                kinds[2] + [("x.py", f"f{r}")] for r in range(16)}
    agg = aggregate(job_stacks(topo, stack_of.get))
    assert agg.ambiguous and agg.healthy == []
    d = decide_eviction(agg, topo)
    assert d.kind is None and d.machines == [] and d.reason.startswith("ambiguous")


# ---------------------------------------------------------------- children
def test_stuck_dataloader_child_makes_its_rank_an_outlier():
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=2)
    stacks = job_stacks(topo, lambda r: GRAD_SYNC)
    for ps in stacks:
        if ps.rank == 6 and ps.role == "dataloader":
            ps.threads = process(DATALOADER_STUCK, ps.pid, variant=6)
    agg = aggregate(stacks)
    assert agg.outliers == [6]
    assert "[dataloader]" in agg.groups[1][0] and "GPTDataset.__getitem__" in agg.groups[1][0]
    assert decide_eviction(agg, topo).machines == [3]


def test_machine_level_helper_applies_to_all_ranks_of_its_machine():
    topo = Topology(machines=4, gpus_per_machine=2, tp=2, pp=2, dp=2)
    helpers = [ProcessStack(None, 5000 + m, "ckpt", m, process(CKPT_WRITE, 5000 + m, variant=m))
               for m in range(4)]
    helpers[1].threads = process(SPAWN + [("stalwart/agent/ckpt.py", "persist_loop"),
                                          ("fsspec/spec.py", "AbstractBufferedFile.flush")], 5001)
    keys = rank_keys(job_stacks(topo, lambda r: GRAD_SYNC, helpers=helpers))
    assert "[ckpt]" in keys[0]
    agg = aggregate(job_stacks(topo, lambda r: GRAD_SYNC, helpers=helpers))
    assert agg.outliers == [2, 3]
    assert decide_eviction(agg, topo).machines == [1]


def test_child_order_does_not_matter_and_empty_input_is_refused():
    topo = Topology(machines=2, gpus_per_machine=1, tp=1, pp=1, dp=2)
    a = job_stacks(topo, lambda r: GRAD_SYNC)
    assert aggregate(list(reversed(a))).outliers == [] == aggregate(a).outliers
    assert isinstance(aggregate(a), Aggregation)
    with pytest.raises(ValueError, match="at least one"):
        aggregate([])


if __name__ == "__main__":
    write_fig7_fixture()
