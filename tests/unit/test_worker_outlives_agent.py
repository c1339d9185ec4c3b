"""A worker outlives its agent for a bound: the SDK's link connects to the agent's socket again
when a restarted agent listens there (what was sent meanwhile arrives), and gives up past the
bound; a plain script's start-up hook exits once the agent named in the work directory's lock
has been gone for the bound."""
import json
import os
import socket
import threading
import time

from stalwart import protocol as p
from stalwart.worker import link as L
from test_plain_hangs import load_frhook


def listen(path: str) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    return srv


def test_the_link_comes_back_to_a_restarted_agent_and_gives_up_past_the_bound(tmp_path, monkeypatch):
    monkeypatch.setenv(p.Env.RELINK_S, "5")
    path = str(tmp_path / "agent.sock")
    srv = listen(path)
    gone = threading.Event()
    lk = L.AgentLink(path, lambda msg: None, on_gone=gone.set)
    assert lk.relink_s == 5.0
    conn, _ = srv.accept()
    old = lk._conn
    conn.close()                         # the agent dies: its end closes, its socket file stays
    srv.close()
    time.sleep(0.3)                      # (the link is retrying now)
    os.unlink(path)
    srv = listen(path)                   # the restarted agent listens at the same path
    srv.settimeout(5.0)
    conn, _ = srv.accept()
    conn.settimeout(5.0)
    lk.send({"type": "step", "step": 7})
    assert json.loads(conn.makefile("rb").readline()) == {"type": "step", "step": 7}
    assert lk._conn is not old
    # past the bound: no agent came back
    lk.relink_s = 0.3
    cur = lk._conn
    t0 = time.monotonic()
    conn.close()
    srv.close()
    os.unlink(path)
    assert gone.wait(timeout=10)          # its reader gave up (a worker's process would end here)
    assert 0.3 <= time.monotonic() - t0 < 5.0
    assert lk._relink(cur) is False
    lk._closed.set()
    lk._put(None, True)


def test_the_hook_stops_a_plain_worker_once_its_agent_is_gone_for_the_bound(tmp_path):
    hook = load_frhook()
    assert (hook.SOCK_ENV, hook.RELINK_ENV) == (p.Env.AGENT_SOCK, p.Env.RELINK_S)
    lock = tmp_path / "agent.lock"
    lock.write_text(f"agent pid {os.getpid()} (machine m0)\n")
    assert hook.agent_alive(str(lock))
    exits: list[int] = []
    t = threading.Thread(target=hook.watch_agent, args=(str(lock), 0.3, 0.05, exits.append), daemon=True)
    t.start()
    time.sleep(0.5)
    assert exits == []                   # its agent lives
    lock.write_text("agent pid 4194303 (machine m0)\n")      # (above pid_max's default: no such process)
    assert not hook.agent_alive(str(lock))
    t.join(timeout=5)
    assert exits == [70]
    assert hook.agent_alive(str(tmp_path / "missing"))       # nothing known: never a reason to stop
