"""The worker SDK tells its agent it is going down with an exception, traceback included, before
the process exits (the agent reports the failure without waiting ~0.5 s for the
interpreter's teardown)."""
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from stalwart.transport.jsonlines import JsonLineSocket

SCRIPT = textwrap.dedent('''
    import sys
    from stalwart import worker
    ctx = worker.init()
    try:
        if sys.argv[1] == "fail":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    finally:
        ctx.finish()
''')


def run_worker(tmp_path, mode):
    code, err, got = serve_worker(tmp_path, SCRIPT, [mode])
    return code, err, [m for _, m in got]


def serve_worker(tmp_path, script: str, args: list[str], **env_extra: str) -> tuple[int, str, list]:
    """Run `script` as a one-rank SDK worker against a listening agent socket (STALWART_* extras
    in `env_extra`); returns its exit code, its stderr and each message with its arrival time."""
    path = str(tmp_path / "agent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    srv.settimeout(60)
    env = dict(os.environ, STALWART_AGENT_SOCK=path, WORLD_SIZE="1", RANK="0", STALWART_FORCE_CPU="1",
               **env_extra)
    env.pop("MASTER_ADDR", None)
    p = subprocess.Popen([sys.executable, "-c", script, *args], env=env, stderr=subprocess.PIPE, text=True)
    got: list[tuple[float, dict]] = []
    try:
        conn, _ = srv.accept()
        jl = JsonLineSocket(conn)
        while (m := jl.recv()) is not None:
            got.append((time.time(), m))
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        srv.close()
    return p.returncode, err, got


@pytest.mark.timeout(120)
def test_a_failing_worker_says_so_with_its_traceback(tmp_path):
    code, _, msgs = run_worker(tmp_path, "fail")
    assert code == 1
    failing = [m for m in msgs if m["type"] == "failing"]
    assert len(failing) == 1 and failing[0]["rank"] == 0, msgs
    assert "RuntimeError: CUDA error: an illegal memory access" in failing[0]["traceback"]
    assert not [m for m in msgs if m["type"] == "done"]


@pytest.mark.timeout(120)
def test_a_worker_that_ends_well_says_done_not_failing(tmp_path):
    code, err, msgs = run_worker(tmp_path, "ok")
    assert code == 0, err
    kinds = [m["type"] for m in msgs]
    assert "done" in kinds and "failing" not in kinds, kinds


OVERLAP_SCRIPT = textwrap.dedent('''
    import sys, threading, torch
    from stalwart import worker
    ctx = worker.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model.register_buffer("seen", torch.zeros(()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for step in range(6):
            ctx.begin_step(step)
            if sys.argv[1] == "buffer" and step == 3:
                model.seen.add_(1)          # a buffer changed in forward, before the fence...
                gate.set()                  # ...and before step 2's copy (held back till now)
            loss = model(torch.ones(4, 8)).square().mean()
            opt.zero_grad()
            loss.backward()
            ctx.on_gradients(step, model.parameters())
            opt.step()
            ctx.report(step, loss=float(loss))
            if sys.argv[1] == "buffer" and step == 2:
                gate = threading.Event()
                ctx.mem._copier.submit(gate.wait)
            ctx.checkpoint({"model": model.state_dict(), "optim": opt.state_dict()}, step)
        torch.save(model.state_dict(), sys.argv[2])
    finally:
        ctx.finish()
''')


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["clean", "buffer"])
def test_overlapped_snapshots_under_the_sdk_hold_each_steps_state(tmp_path, mode):
    """STALWART_MEM_OVERLAP=1: each step's copy overlaps the next step until `on_gradients`; the
    newest shard is the state the script ended with. A buffer changed in forward before the
    fence is seen: that step's shard is dropped, the copies block from then on, the log says so."""
    import torch

    from stalwart.worker import memckpt
    shm, final = tmp_path / "shm", str(tmp_path / "final.pt")
    code, err, got = serve_worker(tmp_path, OVERLAP_SCRIPT, [mode, final], STALWART_SHM_DIR=str(shm),
                                  STALWART_MEM_OVERLAP="1")
    msgs = [m for _, m in got]
    assert code == 0, err
    shards = [m["step"] for m in msgs if m["type"] == "shard"]
    step, state = memckpt.load(str(shm), 0)
    assert step == 5
    want = torch.load(final)
    assert all(torch.equal(state["model"][k], want[k]) for k in want)
    if mode == "clean":
        assert shards == list(range(6)) and "in-memory checkpoint" not in err
    else:
        assert 2 not in shards and shards == [0, 1, 3, 4, 5], shards   # step 2's copy was torn
        assert "in-memory checkpoint: tensor" in err and "modified before its copy" in err


REPORT_SCRIPT = textwrap.dedent('''
    import sys, time, torch
    from stalwart import worker
    from stalwart.worker import link
    link.LAZY_IDLE_S = 60.0              # (a report held back would wait for the next step)
    ctx = worker.init()
    w = torch.zeros(16)
    every = int(sys.argv[1])
    try:
        for step in range(6):
            ctx.begin_step(step)
            w.add_(1)
            ctx.report(step, loss=float(step))
            if (step + 1) % every == 0:
                ctx.checkpoint({"w": w}, step)
            time.sleep(1.5)               # (a long step: what waits for the next one shows)
    finally:
        ctx.finish()
''')


@pytest.mark.timeout(120)
@pytest.mark.parametrize("every", [1, 3])
def test_step_reports_reach_the_agent_within_their_step(tmp_path, every):
    """Every step checkpointed: a report goes with its step's commit message (one write).
    Checkpointed every third step: a report that no snapshot follows is not held for one."""
    code, err, got = serve_worker(tmp_path, REPORT_SCRIPT, [str(every)], STALWART_SHM_DIR=str(tmp_path / "shm"))
    assert code == 0, err
    steps = [(at, m) for at, m in got if m["type"] == "step"]
    assert [m["step"] for _, m in steps] == list(range(6))
    for at, m in steps:
        # within its step (1.5 s), not with the next step's messages nor the writer's 60 s bound;
        # with every third step checkpointed, the report after a snapshot may wait for its step's
        # end (the SDK expected a snapshot to follow it)
        late = every == 3 and m["step"] % 3 == 0 and m["step"] > 0
        assert at - m["t"] < (2.5 if late else 1.0), (m["step"], at - m["t"])
    if every == 1:
        shards = {m["step"]: at for at, m in got if m["type"] == "shard"}
        assert all(abs(shards[m["step"]] - at) < 0.5 for at, m in steps if m["step"] > 0)
