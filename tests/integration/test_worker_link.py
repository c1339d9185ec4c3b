"""The worker SDK tells its agent it is going down with an exception, traceback included, before
the process exits (issue 4: the agent reports the failure without waiting ~0.5 s for the
interpreter's teardown)."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from stalwart.jsonlines import JsonLineSocket

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
    path = str(tmp_path / "agent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    srv.settimeout(60)
    env = dict(os.environ, STALWART_AGENT_SOCK=path, WORLD_SIZE="1", RANK="0", STALWART_FORCE_CPU="1")
    env.pop("MASTER_ADDR", None)
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], env=env, stderr=subprocess.PIPE, text=True)
    msgs = []
    try:
        conn, _ = srv.accept()
        jl = JsonLineSocket(conn)
        while True:
            m = jl.recv()
            if m is None:
                break
            msgs.append(m)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        srv.close()
    return p, msgs


@pytest.mark.timeout(120)
def test_a_failing_worker_says_so_with_its_traceback(tmp_path):
    p, msgs = run_worker(tmp_path, "fail")
    assert p.returncode == 1
    failing = [m for m in msgs if m["type"] == "failing"]
    assert len(failing) == 1 and failing[0]["rank"] == 0, msgs
    assert "RuntimeError: CUDA error: an illegal memory access" in failing[0]["traceback"]
    assert not [m for m in msgs if m["type"] == "done"]


@pytest.mark.timeout(120)
def test_a_worker_that_ends_well_says_done_not_failing(tmp_path):
    p, msgs = run_worker(tmp_path, "ok")
    assert p.returncode == 0, p.stderr.read()
    kinds = [m["type"] for m in msgs]
    assert "done" in kinds and "failing" not in kinds, kinds
