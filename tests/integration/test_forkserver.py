"""The machine's fork server, for real: a server process that preloads modules, forks workers
that become `python -m`, `python SCRIPT` or `python -c` processes, and reports how they end."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from stalwart.agent.forkclient import ForkServers
from stalwart.agent.workers import kill_tree

PY = sys.executable
SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + "/src"


@pytest.fixture
def forks(tmp_path, monkeypatch):
    # a light preload: what is tested is the forking, not torch
    monkeypatch.setenv("STALWART_FORK_PRELOAD", "json,random")
    fs = ForkServers(str(tmp_path / "logs"))
    yield fs
    fs.close()


def env(**extra) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    e.update(PYTHONPATH=SRC, STALWART_FORK_PRELOAD="json,random")
    e.update(extra)
    return e


def read(path) -> str:
    with open(path) as f:
        return f.read()


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_a_forked_worker_is_the_process_its_command_line_makes(forks, tmp_path):
    code = ("import json, os, random, sys; print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), "
            "'rank': os.environ.get('RANK'), 'path0': sys.path[0], 'sid': os.getsid(0) == os.getpid(), "
            "'rand': random.random(), 'main': __name__})); print('to stderr', file=sys.stderr); sys.exit(3)")
    procs = []
    for i in range(2):
        p = forks.spawn([PY, "-u", "-c", code, "x", "y"], env(RANK=str(i)), str(tmp_path),
                        str(tmp_path / f"o{i}"), str(tmp_path / f"e{i}"))
        assert p is not None
        procs.append(p)
    assert [p.wait(30) for p in procs] == [3, 3]
    outs = [json.loads(read(tmp_path / f"o{i}")) for i in range(2)]
    for i, o in enumerate(outs):
        assert o["argv"] == ["-c", "x", "y"] and o["cwd"] == str(tmp_path) and o["rank"] == str(i)
        assert o["path0"] == "" and o["sid"] and o["main"] == "__main__"
        assert read(tmp_path / f"e{i}") == "to stderr\n"
    assert outs[0]["rand"] != outs[1]["rand"]          # reseeded: not the server's random state
    assert procs[0].pid != procs[1].pid


def test_module_and_script_run_as_main_with_their_path(forks, tmp_path):
    pkg = tmp_path / "code"
    pkg.mkdir()
    (pkg / "hello.py").write_text("import sys\nprint('module', __name__, sys.argv[1:])\n")
    (pkg / "script.py").write_text("import os, sys\nprint('script', __name__, os.path.basename(__file__), "
                                   "sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n")
    p = forks.spawn([PY, "-m", "hello", "--a"], env(PYTHONPATH=f"{pkg}:{SRC}"), str(tmp_path),
                    str(tmp_path / "m.out"), str(tmp_path / "m.err"))
    assert p is not None and p.wait(30) == 0
    assert read(tmp_path / "m.out") == "module __main__ ['--a']\n"
    p = forks.spawn([PY, str(pkg / "script.py")], env(), str(tmp_path), str(tmp_path / "s.out"),
                    str(tmp_path / "s.err"))
    assert p is not None and p.wait(30) == 0
    assert read(tmp_path / "s.out") == "script __main__ script.py True\n"
    # a module that does not exist fails as the interpreter does
    p = forks.spawn([PY, "-m", "no_such_module_here"], env(), str(tmp_path), str(tmp_path / "n.out"),
                    str(tmp_path / "n.err"))
    assert p is not None and p.wait(30) == 1
    assert "No module named no_such_module_here" in read(tmp_path / "n.err")


def test_a_sitecustomize_on_the_workers_path_runs_at_start(forks, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import os\nos.environ['HOOKED'] = 'yes'\n")
    p = forks.spawn([PY, "-c", "import os; print(os.environ.get('HOOKED'))"],
                    env(PYTHONPATH=f"{hook}:{SRC}"), str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e"))
    assert p is not None and p.wait(30) == 0
    assert read(tmp_path / "o") == "yes\n"


def test_exit_by_signal_and_the_servers_death(forks, tmp_path):
    p = forks.spawn([PY, "-c", "import time; time.sleep(60)"], env(), str(tmp_path), str(tmp_path / "o"),
                    str(tmp_path / "e"))
    assert p is not None
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL and p.exited()
    # a server that dies takes its workers along, and they are reported ended
    q = forks.spawn([PY, "-c", "import time; time.sleep(60)"], env(), str(tmp_path), str(tmp_path / "o2"),
                    str(tmp_path / "e2"))
    assert q is not None
    (server,) = forks._servers.values()
    kill_tree(server.proc.pid)
    assert q.wait(30) == -signal.SIGKILL
    assert wait_for(lambda: not os.path.exists(f"/proc/{q.pid}") or q.exited())
    # the next spawn starts a new server
    r = forks.spawn([PY, "-c", "print('again')"], env(), str(tmp_path), str(tmp_path / "o3"), str(tmp_path / "e3"))
    assert r is not None and r.wait(30) == 0 and read(tmp_path / "o3") == "again\n"


def test_what_it_cannot_become_is_execd_and_left_to_the_caller_only_with_both_off(forks, tmp_path):
    p = forks.spawn(["/bin/echo", "hi"], env(), str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e"))
    assert p is not None and p.wait(30) == 0 and read(tmp_path / "o") == "hi\n"
    p = forks.spawn([PY, "-X", "dev", "-c", "import sys; print(sys.flags.dev_mode)"], env(), str(tmp_path),
                    str(tmp_path / "o2"), str(tmp_path / "e2"))
    assert p is not None and p.wait(30) == 0 and read(tmp_path / "o2") == "True\n"
    assert len(forks._execs) == 1 and not forks._servers        # (no preloading server was needed)
    off = ForkServers(str(tmp_path / "off"), enabled=False)
    try:
        p = off.spawn([PY, "-c", "print('execd')"], env(), str(tmp_path), str(tmp_path / "o3"), str(tmp_path / "e3"))
        assert p is not None and p.wait(30) == 0 and read(tmp_path / "o3") == "execd\n"
    finally:
        off.close()
    none = ForkServers(str(tmp_path / "none"), enabled=False, exec_enabled=False)
    assert none.spawn([PY, "-c", "pass"], env(), str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e")) is None


def test_an_execd_worker_is_the_process_its_command_line_makes(forks, tmp_path):
    """Not a `python` line the fork server accepts (`env` starts the interpreter): exec'd from the
    exec server, with its environment, cwd, files, own session, niceness and death signal; a
    program that cannot run is an error answer, and no child is left."""
    code = ("import ctypes, json, os, sys; sig = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(sig)); "
            "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'rank': os.environ.get('RANK'), "
            "'sid': os.getsid(0) == os.getpid(), 'ppid': os.getppid(), 'pdeathsig': sig.value, "
            "'nice': os.getpriority(os.PRIO_PROCESS, 0), 'stdin': os.read(0, 10).decode()})); "
            "print('to stderr', file=sys.stderr); sys.exit(5)")
    nice = 10 if os.geteuid() == 0 else 0
    p = forks.spawn(["/usr/bin/env", PY, "-c", code, "x"], env(RANK="4"), str(tmp_path), str(tmp_path / "o"),
                    str(tmp_path / "e"), nice=nice)
    assert p is not None and p.wait(30) == 5
    [server] = forks._execs.values()
    got = json.loads(read(tmp_path / "o"))
    assert got == {"argv": ["-c", "x"], "cwd": str(tmp_path), "rank": "4", "sid": True, "ppid": server.proc.pid,
                   "pdeathsig": signal.SIGKILL, "nice": nice, "stdin": ""}
    assert read(tmp_path / "e") == "to stderr\n"
    assert forks.spawn(["no-such-program-here"], env(), str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e")) is None
    assert forks.spawn(["true"], env(), str(tmp_path / "no-such-dir"), str(tmp_path / "o"), str(tmp_path / "e")) is None
    assert not [c for c in psutil.Process(server.proc.pid).children()]     # (the failed ones reaped)


def test_an_orphaned_exec_server_keeps_its_workers_notes_their_exits_and_bounds_them(tmp_path):
    """Its agent gone (a bare end of its input): the exec'd workers live on and their exits are
    noted; one that names its agent's work directory is stopped once no agent has held it for its
    bound (the agent named in `agent.lock` is dead here), as a Python worker's hook would stop it."""
    fs = ForkServers(str(tmp_path / "logs"), exits_dir=str(tmp_path / "exits"))
    workdir = tmp_path / "w"
    workdir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (workdir / "agent.lock").write_text(f"agent pid {dead.pid} (machine m0)\n")
    go = tmp_path / "go"
    try:
        bounded = fs.spawn(["bash", "-c", "while true; do sleep 0.05; done"],
                           env(STALWART_AGENT_SOCK=str(workdir / "agent.sock"), STALWART_RELINK_S="1"),
                           str(tmp_path), str(tmp_path / "b.out"), str(tmp_path / "b.err"))
        free = fs.spawn(["bash", "-c", f"until [ -e {go} ]; do sleep 0.02; done; exit 3"], env(), str(tmp_path),
                        str(tmp_path / "f.out"), str(tmp_path / "f.err"))
        assert bounded is not None and free is not None
        [srv] = fs._execs.values()
        srv.proc.stdin.close()                    # the agent is gone (no `quit`)
        assert wait_for(lambda: os.path.exists(tmp_path / "exits" / str(bounded.pid)), timeout=10)
        assert read(tmp_path / "exits" / str(bounded.pid)) == str(-signal.SIGKILL)
        assert "the agent has been gone for 1s: this worker stops" in read(tmp_path / "b.err")
        assert srv.proc.poll() is None and os.path.exists(f"/proc/{free.pid}")     # no bound: lives on
        go.touch()
        assert wait_for(lambda: os.path.exists(tmp_path / "exits" / str(free.pid)))
        assert read(tmp_path / "exits" / str(free.pid)) == "3"
        assert srv.proc.wait(timeout=10) == 0     # its last worker ended: so does the server
    finally:
        go.touch()
        for s in fs._execs.values():
            kill_tree(s.proc.pid)
        fs._execs.clear()


def test_the_agents_own_child_when_no_server_can_start_it_says_so(tmp_path, caplog):
    from stalwart.agent.workers import WorkerSet
    ws = WorkerSet(str(tmp_path), lambda w: None, ForkServers(str(tmp_path / "l"), enabled=False, exec_enabled=False))
    with caplog.at_level("WARNING", logger="stalwart.agent"):
        ws.spawn(["bash", "-c", "exit 0"], [env()], [0], run=1, cwd=str(tmp_path), tag="run1")
    [w] = ws.workers
    assert isinstance(w.proc, subprocess.Popen) and w.proc.wait(10) == 0
    assert f"run1_rank0 (pid {w.proc.pid}) started as the agent's own child" in caplog.text


def test_another_import_environment_gets_its_own_server_and_live_workers_stay(forks, tmp_path):
    a = forks.spawn([PY, "-c", "import time; time.sleep(60)"], env(OMP_NUM_THREADS="1"), str(tmp_path),
                    str(tmp_path / "a.out"), str(tmp_path / "a.err"))
    assert a is not None
    b = forks.spawn([PY, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"], env(OMP_NUM_THREADS="2"),
                    str(tmp_path), str(tmp_path / "b.out"), str(tmp_path / "b.err"))
    assert b is not None and b.wait(30) == 0 and read(tmp_path / "b.out") == "2\n"
    assert len(forks._servers) == 2 and a.poll() is None      # the first server still runs its worker
    os.kill(a.pid, signal.SIGKILL)
    assert a.wait(30) == -signal.SIGKILL
    c = forks.spawn([PY, "-c", "pass"], env(OMP_NUM_THREADS="2"), str(tmp_path), str(tmp_path / "c.out"),
                    str(tmp_path / "c.err"))
    assert c is not None and c.wait(30) == 0
    assert wait_for(lambda: len(forks._servers) == 1)          # the idle one of the other key ended


def test_nice_puts_a_spare_in_the_background(forks, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("lowering a niceness back needs root; the agent nices spares only as root")
    p = forks.spawn([PY, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))"],
                    env(), str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e"), nice=10)
    assert p is not None and p.wait(30) == 0
    assert read(tmp_path / "o").split() == ["10", str(os.SCHED_IDLE)]


def test_the_worker_shows_its_own_command_line(forks, tmp_path):
    import psutil

    from stalwart.protocol import WARM_TITLE_MARK
    p = forks.spawn([PY, "-c", "import time; time.sleep(60)", "marker-arg"], env(STALWART_STANDBY="1"),
                    str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e"))
    assert p is not None
    try:
        assert wait_for(lambda: "marker-arg" in " ".join(psutil.Process(p.pid).cmdline()))
        assert " ".join(psutil.Process(p.pid).cmdline()).strip().endswith(WARM_TITLE_MARK.strip())
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)


def test_a_relative_script_has_an_absolute_file_and_traceback(forks, tmp_path):
    (tmp_path / "boom.py").write_text("import sys\nprint(__file__, sys.argv[0])\nraise IndexError('bucket')\n")
    p = forks.spawn([PY, "boom.py"], env(), str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e"))
    assert p is not None and p.wait(30) == 1
    assert read(tmp_path / "o") == f"{tmp_path / 'boom.py'} boom.py\n"
    err = read(tmp_path / "e")
    assert f'File "{tmp_path / "boom.py"}", line 3' in err and "IndexError: bucket" in err


def test_a_server_whose_agent_died_keeps_its_workers_and_notes_their_exits(tmp_path, monkeypatch):
    """A bare end of the server's input (its agent died) leaves the workers running for a
    successor; each exit goes to `<exits_dir>/<pid>`, and the server ends with the last one.
    `close()` (an agent that stops) still ends them all."""
    monkeypatch.setenv("STALWART_FORK_PRELOAD", "json,random")
    fs = ForkServers(str(tmp_path / "logs"), exits_dir=str(tmp_path / "exits"))
    try:
        go = tmp_path / "go"
        code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)\nraise SystemExit(3)"
        p = fs.spawn([PY, "-c", code], env(), str(tmp_path), str(tmp_path / "o"), str(tmp_path / "e"))
        assert p is not None
        [srv] = fs._servers.values()
        srv.proc.stdin.close()                    # the agent is gone (no `quit`)
        time.sleep(0.5)
        assert srv.proc.poll() is None and os.path.exists(f"/proc/{p.pid}")     # both live on
        go.touch()
        assert wait_for(lambda: os.path.exists(tmp_path / "exits" / str(p.pid)))
        assert read(tmp_path / "exits" / str(p.pid)) == "3"
        assert srv.proc.wait(timeout=10) == 0     # its last worker ended: so does the server
    finally:
        fs._servers.clear()
    fs2 = ForkServers(str(tmp_path / "logs2"), exits_dir=str(tmp_path / "exits"))
    p = fs2.spawn([PY, "-c", "import time; time.sleep(60)"], env(), str(tmp_path), str(tmp_path / "o2"),
                  str(tmp_path / "e2"))
    assert p is not None
    fs2.close()                                   # `quit`: the workers go with the server
    assert p.wait(10) == -signal.SIGKILL
