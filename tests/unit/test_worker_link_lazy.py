"""The worker's link: a message that may wait goes with the next one, or within a bound."""
import json
import socket
import time

import pytest

from stalwart.worker import link as L


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "LAZY_KEEP_S", 0.3)
    path = str(tmp_path / "agent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    lk = L.AgentLink(path, lambda msg: None)
    conn, _ = srv.accept()
    conn.settimeout(5.0)
    yield lk, conn
    lk._closed.set()
    lk._put(None, True)
    conn.close()
    srv.close()


def read_lines(conn, n):
    buf = b""
    while buf.count(b"\n") < n:
        buf += conn.recv(65536)
    return [json.loads(x) for x in buf.splitlines()]


def test_a_lazy_message_goes_with_the_next_one_in_order(pair):
    lk, conn = pair
    lk.send({"type": "step", "step": 1}, wake=False)
    lk.send({"type": "shard", "step": 1})
    assert [m["type"] for m in read_lines(conn, 2)] == ["step", "shard"]


def test_a_lazy_message_alone_goes_within_the_bound_even_after_a_long_idle(pair):
    lk, conn = pair
    deadline = time.monotonic() + 5.0
    while not lk._untimed:                      # idle past LAZY_KEEP_S: the writer sleeps unbounded
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.monotonic()
    lk.send({"type": "step", "step": 7}, wake=False)
    assert read_lines(conn, 1) == [{"type": "step", "step": 7}]
    assert time.monotonic() - t0 < 2.0
    lk.send({"type": "step", "step": 8}, wake=False)     # (bounded again while lazy ones come)
    assert read_lines(conn, 1) == [{"type": "step", "step": 8}]


def test_a_lazy_message_no_prompt_one_follows_goes_with_the_next_lazy_one(pair, monkeypatch):
    """A job that checkpoints every few steps: each step's report takes the one before along
    (the writer is not waiting out LAZY_IDLE_S, here far longer than the read's timeout)."""
    monkeypatch.setattr(L, "LAZY_IDLE_S", 60.0)
    lk, conn = pair
    lk.send({"type": "step", "step": 1}, wake=False)    # (after an idle: the writer looks at once)
    assert [m["step"] for m in read_lines(conn, 1)] == [1]
    lk.send({"type": "step", "step": 2}, wake=False)    # (waits: the writer sleeps 60 s now)
    time.sleep(L.LAZY_S * 1.5)
    lk.send({"type": "step", "step": 3}, wake=False)
    assert [m["step"] for m in read_lines(conn, 2)] == [2, 3]


def test_a_lone_lazy_message_goes_within_the_idle_bound(pair, monkeypatch):
    monkeypatch.setattr(L, "LAZY_IDLE_S", 0.2)
    lk, conn = pair
    lk.send({"type": "hello"})                   # (the writer now waits with the idle bound)
    assert read_lines(conn, 1) == [{"type": "hello"}]
    lk.send({"type": "step", "step": 3}, wake=False)
    assert read_lines(conn, 1) == [{"type": "step", "step": 3}]


def test_the_writer_wakes_for_prompt_messages_not_on_a_tick(pair, monkeypatch):
    """Every step a lazy report then its commit's message: one wake-up a step, no polling."""
    monkeypatch.setattr(L, "LAZY_IDLE_S", 60.0)
    lk, conn = pair
    waits = []
    real = lk._cv.wait
    lk._cv.wait = lambda timeout=None: (waits.append(timeout), real(timeout))[1]  # type: ignore[method-assign]
    for step in range(5):
        lk.send({"type": "step", "step": step}, wake=False)
        lk.send({"type": "shard", "step": step})
        time.sleep(0.01)
    got = read_lines(conn, 10)
    time.sleep(0.3)                              # (a writer polling every LAZY_S would wake 6 times)
    assert [(m["type"], m["step"]) for m in got] == [(t, s) for s in range(5) for t in ("step", "shard")]
    assert len(waits) <= 5 + 1
