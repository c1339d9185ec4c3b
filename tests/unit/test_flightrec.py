"""Flight-recorder laggard analysis: recorded gloo dumps, and one live 2-rank job.

Run ``python tests/unit/test_flightrec.py record`` to re-record the fixtures
``fixtures/stacks/fr_rank{0,1}.json`` from a real gloo job.
"""

import json
import os
import pathlib
import sys
import tempfile
import time

import pytest

from stalwart.analyzer.flightrec import laggards, parse, stuck_ranks

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "stacks"


def _worker(rank, world, store_path, out_dir):
    """A rank of a 2-rank gloo job that deadlocks on purpose, then dumps its recorder.

    Both ranks run 3 all_reduce + 1 broadcast on the default group, a send/recv pair
    and one all_reduce on a sub-group.  Then rank 0 enters a 5th all_reduce on the
    default group while rank 1 skips it and enters a broadcast on the sub-group: each
    waits for the other forever.  A side thread dumps the flight recorder once the
    main thread's collective shows up unfinished in it.
    """
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.broadcast(t, 0)
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    sub = dist.new_group([0, 1])
    dist.all_reduce(t, group=sub)

    # the collective each rank blocks in: (pg_id, collective_seq_id)
    last = (0, 5) if rank == 0 else (1, 2)

    def dump_when_blocked():
        """Dump once the blocking collective is in the recorder and everything before it retired
        (an earlier collective can show unretired for a moment after it completed)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            raw = torch._C._distributed_c10d._dump_fr_trace_json()
            raw = raw.decode() if isinstance(raw, bytes) else raw
            entries = json.loads(raw)["entries"]
            blocked = [e for e in entries if (e["pg_id"], e["collective_seq_id"]) == last]
            if blocked and not blocked[0]["retired"] and all(e["retired"] for e in entries
                                                             if e is not blocked[0]):
                tmp = os.path.join(out_dir, f".fr_rank{rank}.tmp")
                with open(tmp, "w") as f:
                    f.write(raw)
                os.rename(tmp, os.path.join(out_dir, f"fr_rank{rank}.json"))
                return
            time.sleep(0.05)

    threading.Thread(target=dump_when_blocked, daemon=True).start()
    if rank == 0:
        dist.all_reduce(t)           # rank 1 never joins
    else:
        dist.broadcast(t, 0, group=sub)  # rank 0 never joins
    time.sleep(60)


def run_deadlocked_job(out_dir, bound_s=45.0):
    """Start the 2-rank job, wait (bounded) for both dumps, kill both ranks; return dumps."""
    import torch.multiprocessing as mp

    store = os.path.join(out_dir, "store")
    saved = os.environ.get("TORCH_FR_BUFFER_SIZE")
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # inherited by the spawned ranks
    try:
        ctx = mp.start_processes(_worker, args=(2, store, out_dir), nprocs=2, join=False,
                                 start_method="spawn")
    finally:
        if saved is None:
            del os.environ["TORCH_FR_BUFFER_SIZE"]
        else:
            os.environ["TORCH_FR_BUFFER_SIZE"] = saved
    try:
        files = [os.path.join(out_dir, f"fr_rank{r}.json") for r in range(2)]
        deadline = time.monotonic() + bound_s
        while not all(os.path.exists(f) for f in files):
            dead = [p for p in ctx.processes if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"a rank exited early with code {dead[0].exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError("no flight-recorder dump within the bound")
            time.sleep(0.1)
        return {r: open(f).read() for r, f in enumerate(files)}
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(10)


def _check_deadlock(lags):
    assert set(lags) == {"0", "1"}
    g0, g1 = lags["0"], lags["1"]
    assert g0.pg_name == "default_pg"
    assert g0.stuck_op == "gloo:all_reduce" and g0.stuck_seq == 5
    assert g0.waiting == [0] and g0.laggards == [1] and g0.last_seq == {0: 5, 1: 4}
    assert g0.laggard_stuck_on[1].name == "gloo:broadcast"
    assert g0.laggard_stuck_on[1].pg_id == "1"
    assert g1.stuck_op == "gloo:broadcast" and g1.waiting == [1] and g1.laggards == [0]
    assert g1.laggard_stuck_on[0].name == "gloo:all_reduce"
    assert stuck_ranks(lags) == [0, 1]


def load_fixture():
    return {r: (FIXTURES / f"fr_rank{r}.json").read_text() for r in range(2)}


def test_recorded_dumps_have_the_expected_format():
    ops = parse(load_fixture()[0])
    assert not [o for o in ops if o.is_p2p]  # gloo's recorder leaves send/recv out
    assert {(o.pg_id, o.pg_name) for o in ops} == {("0", "default_pg"), ("1", "undefined")}
    assert [o.seq for o in ops if o.pg_id == "0" and not o.is_p2p] == [1, 2, 3, 4, 5]
    assert [o.retired for o in ops if o.pg_id == "0" and not o.is_p2p] == [True] * 4 + [False]


def test_recorded_cross_deadlock_names_laggards_on_both_groups():
    _check_deadlock(laggards(load_fixture()))
    assert json.dumps(laggards(load_fixture())["0"].as_dict())


def test_rank_that_skipped_a_collective_is_the_laggard():
    """Rank 1 never reached all_reduce #5 and has nothing in flight (e.g. stuck in compute)."""
    d1 = json.loads(load_fixture()[1])
    d1["entries"] = [e for e in d1["entries"] if e["pg_id"] != 1]
    lags = laggards({0: load_fixture()[0], 1: d1})
    assert list(lags) == ["0"]
    assert lags["0"].laggards == [1] and lags["0"].laggard_stuck_on == {1: None}


def test_member_without_entries_counts_via_pg_ranks():
    lags = laggards({0: load_fixture()[0], 1: json.dumps({"entries": []})}, pg_ranks={"0": [0, 1]})
    assert lags["0"].last_seq == {0: 5, 1: 0} and lags["0"].laggards == [1]


def test_healthy_dumps_report_nothing():
    healthy = json.loads(load_fixture()[0])
    healthy["entries"] = [dict(e, retired=True) for e in healthy["entries"]
                          if e["collective_seq_id"] <= 4 and e["pg_id"] == 0]
    assert laggards({0: healthy, 1: healthy}) == {}
    assert set(laggards({0: healthy, 1: healthy}, only_stuck=False)) == {"0"}


def test_bad_dumps_are_refused():
    with pytest.raises(ValueError, match="not JSON"):
        laggards({0: "{nope"})
    with pytest.raises(ValueError, match="entries"):
        laggards({0: {"entries": 3}})
    with pytest.raises(ValueError, match="malformed"):
        laggards({0: {"entries": [{"collective_seq_id": 1}]}})
    with pytest.raises(ValueError, match="at least one"):
        laggards({})


@pytest.mark.timeout(60)
def test_live_gloo_deadlock():
    with tempfile.TemporaryDirectory() as d:
        _check_deadlock(laggards(run_deadlocked_job(d)))


if __name__ == "__main__" and sys.argv[1:] == ["record"]:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        for r, raw in run_deadlocked_job(d).items():
            (FIXTURES / f"fr_rank{r}.json").write_text(json.dumps(json.loads(raw), indent=1) + "\n")
    print("recorded", sorted(p.name for p in FIXTURES.glob("fr_rank*.json")))
