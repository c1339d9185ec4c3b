"""The agent's worker server reads typed messages: each kind of a worker's message goes where the
agent routes it, the agent's own messages reach the worker typed, and a line that is not a
worker's message (or a handler that fails) never cuts the worker off from its agent."""
from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading

import pytest

from stalwart import protocol as p
from stalwart.agent.workerserver import WorkerRoutes, WorkerServer

WAIT_S = 10.0


class Recorder:
    """Routes that note what reached them, in order, on one queue."""

    def __init__(self, fail_steps: int = 0):
        self.got: queue.Queue = queue.Queue()
        self.fail_steps = fail_steps

    def routes(self) -> WorkerRoutes:
        def step(msg: p.Step) -> None:
            if self.fail_steps:
                self.fail_steps -= 1
                raise RuntimeError("a handler that fails")
            self.got.put(("step", msg))

        return WorkerRoutes(linked=lambda pid: self.got.put(("linked", pid)),
                            standby_ready=lambda pid: self.got.put(("standby_ready", pid)),
                            failing=lambda pid, msg: self.got.put(("failing", pid, msg)),
                            shard=lambda msg: self.got.put(("shard", msg)),
                            step=step, forward=lambda msg: self.got.put(("forward", msg)))

    def next(self) -> tuple:
        return self.got.get(timeout=WAIT_S)


@pytest.fixture
def linked(tmp_path):
    """A started server and one worker's end of its link (this process, as the worker)."""
    made: list = []

    def make(rec: Recorder) -> tuple[WorkerServer, socket.socket]:
        server = WorkerServer(str(tmp_path / "agent.sock"), threading.Event())
        server.start(rec.routes())
        worker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        worker.settimeout(WAIT_S)
        worker.connect(server.path)
        made.append((server, worker))
        assert rec.next() == ("linked", os.getpid())
        return server, worker

    yield make
    for server, worker in made:
        worker.close()
        server.close()


def send(worker: socket.socket, *msgs: dict | str) -> None:
    worker.sendall("".join((m if isinstance(m, str) else json.dumps(m)) + "\n" for m in msgs).encode())


def test_each_kind_of_worker_message_is_routed(linked):
    rec = Recorder()
    server, worker = linked(rec)
    pid = os.getpid()
    step = p.Step(rank=3, step=7, t=1.0, loss=float("nan"))
    send(worker, *(p.encode(m) for m in (
        p.Hello(rank=3, pid=pid), step, p.Ckpt(rank=3, step=7, tier="durable"), p.Restored(rank=3, step=6),
        p.Done(rank=3), p.Shard(rank=3, step=7, path="/dev/shm/x"), p.Failing(rank=3, traceback="boom"))))
    assert rec.next() == ("forward", p.Hello(rank=3, pid=pid))
    kind, got = rec.next()
    assert kind == "step" and got.rank == 3 and got.step == 7 and got.loss != got.loss     # (a NaN loss)
    assert rec.next() == ("forward", got)
    assert rec.next() == ("forward", p.Ckpt(rank=3, step=7, tier="durable"))
    assert rec.next() == ("forward", p.Restored(rank=3, step=6))
    assert rec.next() == ("forward", p.Done(rank=3))
    assert rec.next() == ("shard", p.Shard(rank=3, step=7, path="/dev/shm/x"))      # not passed on
    assert rec.next() == ("failing", pid, p.Failing(rank=3, traceback="boom"))      # not passed on

    # a warm worker at its barrier: noted, routed, passed on; its activation takes it off the list
    send(worker, p.encode(p.StandbyReady(pid=pid)))
    assert rec.next() == ("standby_ready", pid)
    assert rec.next() == ("forward", p.StandbyReady(pid=pid))
    assert server.standbys(linked=True) == [pid] and server.has_link(pid)
    assert server.send(pid, p.WorkerChaos(kind="nan", rank=3, from_step=5))
    server.activate(pid, p.Activate(env={"RANK": "3"}))
    lines = worker.makefile("rb")
    assert p.decode_to_worker(json.loads(lines.readline())) == p.WorkerChaos(kind="nan", rank=3, from_step=5)
    assert p.decode_to_worker(json.loads(lines.readline())) == p.Activate(env={"RANK": "3"})
    assert server.standbys() == []
    assert rec.got.empty()


def test_a_bad_line_or_a_failed_handler_does_not_cut_the_worker_off(linked, caplog):
    rec = Recorder(fail_steps=1)
    server, worker = linked(rec)
    pid = os.getpid()
    with caplog.at_level(logging.WARNING, logger="stalwart.agent"):
        send(worker, "not json {", "[1, 2]", {"type": "no-such-kind"}, {"type": "step", "rank": "three", "step": 1},
             {"rank": 1}, p.encode(p.Step(rank=1, step=1, t=1.0)), p.encode(p.Hello(rank=1)))
        # the first step's handler raised (logged): it was not passed on; the link goes on
        assert rec.next() == ("forward", p.Hello(rank=1))
    assert rec.got.empty()                          # the five bad lines went nowhere
    dropped = [r.getMessage() for r in caplog.records if "message dropped" in r.getMessage()]
    assert len(dropped) == 3                        # (a connection's first few are logged)
    assert "not JSON" in dropped[0] and "array" in dropped[1] and "no-such-kind" in dropped[2]
    assert any("handling its Step message failed" in r.getMessage() for r in caplog.records)
    assert server.has_link(pid)
    assert not server.send(pid + 1, p.WorkerChaos(kind="nan"))       # no link: said, not raised

    worker.close()                                  # the worker went: its link is gone
    for _ in range(int(WAIT_S / 0.01)):
        if not server.has_link(pid):
            break
        threading.Event().wait(0.01)
    assert not server.has_link(pid)


def test_the_sdk_reads_its_agents_messages_typed_and_drops_a_bad_line(tmp_path, monkeypatch, caplog):
    from stalwart.worker.link import AgentLink
    monkeypatch.delenv(p.Env.RELINK_S, raising=False)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp_path / "agent.sock"))
    srv.listen(1)
    srv.settimeout(WAIT_S)
    got: queue.Queue = queue.Queue()
    link = AgentLink(str(tmp_path / "agent.sock"), got.put)
    agent, _ = srv.accept()
    try:
        with caplog.at_level(logging.WARNING, logger="stalwart.worker"):
            send(agent, "not json {", {"type": "no-such-kind"}, {"type": "activate", "env": "not a map"},
                 p.encode(p.WorkerChaos(kind="nan", from_step=3)), p.encode(p.Activate(env={"RANK": "1"})))
            assert got.get(timeout=WAIT_S) == p.WorkerChaos(kind="nan", from_step=3)
            assert got.get(timeout=WAIT_S) == p.Activate(env={"RANK": "1"})
        assert got.empty()
        assert len([r for r in caplog.records if "from the agent dropped" in r.getMessage()]) == 3
    finally:
        link.close()            # (first: a link whose agent goes away ends its worker)
        agent.close()
        srv.close()
