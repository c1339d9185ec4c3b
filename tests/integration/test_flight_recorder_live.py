"""Flight-recorder laggard analysis on a live 2-rank gloo job that deadlocks on purpose.

Run ``python tests/integration/test_flight_recorder_live.py record`` to re-record the unit tests'
fixtures ``tests/unit/fixtures/stacks/fr_rank{0,1}.json`` from it.
"""

import json
import os
import sys
import tempfile
import time

import pytest

from stalwart.analyzer.flightrec import laggards
from test_flightrec import FIXTURES, _check_deadlock


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
