"""Backup pushes keep their lane's connection from one step to the next (agent/peerxfer.py)."""
import socket

from stalwart.agent.peerxfer import PeerClient, PeerServer
from stalwart.agent.shards import ShardStore
from stalwart.worker import memckpt
from stalwart.worker.memckpt import MemCheckpointer


def test_pushes_of_successive_steps_share_one_connection_and_survive_its_loss(tmp_path):
    """...and the receiving side is told of every stored shard and the run that made it (the
    holder reports a backup: its report may wait for company, the pusher's could not)."""
    store = ShardStore(str(tmp_path / "peer-own"), str(tmp_path / "backup"), keep_backup=2)
    accepted, stored = [], []

    def on_stored(hdr, run):
        stored.append((hdr["step"], run))
    with PeerServer("127.0.0.1", 0, store, on_stored=on_stored) as srv, PeerClient(timeout_s=10) as client, \
            MemCheckpointer(str(tmp_path / "own"), rank=0) as ck:
        real = srv._srv.get_request

        def counting():
            conn = real()
            accepted.append(conn)
            return conn
        srv._srv.get_request = counting            # type: ignore[method-assign]
        import torch
        w = torch.zeros(1000)

        def push(step: int) -> str:
            w.fill_(step)
            ck.snapshot({"w": w}, step)
            ck.wait()
            return client.push(srv.address, 0, step, memckpt.latest(str(tmp_path / "own"), 0)[1],
                               run=7).result(10)

        assert [push(s) for s in range(3)] == ["sent"] * 3
        assert len(accepted) == 1 and srv.received == 3           # one connection for three steps
        assert stored == [(0, 7), (1, 7), (2, 7)]                  # the holder hears of each, with its run
        lane = next(iter(client._lanes.values()))
        assert lane.sock is not None
        lane.sock.shutdown(socket.SHUT_RDWR)                      # the kept connection breaks...
        assert push(3) == "sent" and len(accepted) == 2           # ...the next push reconnects once
        assert client.list(srv.address)["backup"][0] == [2, 3]
    store.close()


def test_a_peer_that_stops_answering_fails_the_push_with_a_timeout_once(tmp_path):
    """The lanes' sockets block and the kernel times them out: a peer that takes the data and
    never answers fails the push with TimeoutError after the client's timeout, not twice it."""
    import time

    import pytest
    import torch
    mute = socket.create_server(("127.0.0.1", 0))
    conns = []
    try:
        with PeerClient(timeout_s=0.5) as client, MemCheckpointer(str(tmp_path / "own"), rank=0) as ck:
            ck.snapshot({"w": torch.ones(1000)}, 0)
            ck.wait()
            fut = client.push(mute.getsockname(), 0, 0, memckpt.latest(str(tmp_path / "own"), 0)[1])
            conns.append(mute.accept()[0])          # accepted, never read from nor answered
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="stalled"):
                fut.result(30)
            assert time.monotonic() - t0 < 5
            assert len(client._lanes) == 1 and next(iter(client._lanes.values())).sock is None  # dropped
    finally:
        for c in conns:
            c.close()
        mute.close()


def test_a_server_sleeps_until_a_peer_connects_and_stops_at_once(tmp_path, monkeypatch):
    """No polling: the accept loop's bound is long, and `stop` wakes it by connecting."""
    import time

    from stalwart.agent import peerxfer
    monkeypatch.setattr(peerxfer, "SERVE_POLL_S", 120.0)
    store = ShardStore(str(tmp_path / "peer-own"), str(tmp_path / "backup"), keep_backup=2)
    srv = PeerServer("127.0.0.1", 0, store).start()
    try:
        with PeerClient(timeout_s=10) as client:
            assert client.list(srv.address) == {"own": {}, "backup": {}, "durable": {}}
    finally:
        t0 = time.monotonic()
        srv.stop()
        store.close()
    assert time.monotonic() - t0 < 60            # (without the wake-up: the 120 s bound)
    assert srv._thread is None
    try:
        socket.create_connection(srv.address, timeout=2).close()
        refused = False
    except OSError:
        refused = True
    assert refused
