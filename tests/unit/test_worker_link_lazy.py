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
