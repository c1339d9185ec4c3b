"""Backups filled from an identical local shard (a data-parallel replica's own slot): real
sockets between a PeerClient and a PeerServer, real shared-memory slots written by the SDK's
MemCheckpointer."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading

import pytest
import torch

from stalwart.agent import peerxfer
from stalwart.agent.peerxfer import PeerClient, PeerServer
from stalwart.agent.shards import ShardStore
from stalwart.worker import memckpt
from stalwart.worker.memckpt import MemCheckpointer


@pytest.fixture
def holder():
    """(store, server, pusher's own dir): a backup holder whose machine runs rank 2, and the
    pusher's memory, under one /dev/shm directory removed afterwards."""
    root = tempfile.mkdtemp(prefix="stalwart-test-twins-",
                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    store = ShardStore(os.path.join(root, "m1-own"), os.path.join(root, "m1-backup"), keep_backup=2)
    srv = PeerServer("127.0.0.1", 0, store).start()
    try:
        yield store, srv, os.path.join(root, "m0-own")
    finally:
        srv.stop()
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(1 << 16, generator=g)}, "optim": {"step": seed}}


def _commit(ck: MemCheckpointer, state: dict, step: int) -> str:
    ck.snapshot(state, step)
    ck.wait()
    return memckpt.latest(ck.dir, ck.rank)[1]


def _backup(store: ShardStore, rank: int, step: int) -> dict:
    _, state = memckpt.load(store.fetch(rank, step, "backup"), rank)
    return state


def _held(store: ShardStore, rank: int, step: int) -> bool:
    return os.path.exists(memckpt.step_base(store.backup_dir, rank, step) + ".hdr")


@pytest.mark.timeout(120)
def test_a_replicas_shard_is_held_by_reference_and_other_bytes_still_travel(holder):
    store, srv, own = holder
    with MemCheckpointer(own, rank=0) as pusher, MemCheckpointer(store.shm_dir, rank=2) as twin, \
            PeerClient(timeout_s=30) as client:
        # step 3: rank 2 on the holder has the same state as rank 0: nothing crosses, nothing
        # is copied until the backup tier is read
        _commit(twin, _state(3), 3)
        assert client.push(srv.address, 0, 3, _commit(pusher, _state(3), 3)).result(60) == "sent"
        assert (srv.received, srv.filled) == (1, 1)
        assert store.twins.twin_of(0) == 2
        assert store.twins.virtual() == [(0, 3)] and not _held(store, 0, 3)
        # any reader of the tier (here a fetch, as a restore does) finds an ordinary shard
        memckpt.verify_shard(store.fetch(0, 3, "backup"))
        assert store.twins.virtual() == [] and _held(store, 0, 3)
        got = _backup(store, 0, 3)
        assert torch.equal(got["model"]["w"], _state(3)["model"]["w"]) and got["optim"] == {"step": 3}
        # an ordinary file from then on: the twin's slot being reused does not touch it
        _commit(twin, _state(4), 4)
        assert client.push(srv.address, 0, 4, _commit(pusher, _state(4), 4)).result(60) == "sent"
        _commit(twin, _state(50), 5)
        _commit(twin, _state(60), 6)
        memckpt.verify_shard(store.fetch(0, 3, "backup"))
        # ... while step 4, still a reference when the twin reused its slot (step 6), is gone,
        # as the twin's own copy of it is
        assert client.list(srv.address)["backup"][0] == [3]

        # step 7: the replicas differ (the twin already has step 7, other bytes): the data
        # travels, and the twin is forgotten
        _commit(twin, _state(77), 7)
        assert client.push(srv.address, 0, 7, _commit(pusher, _state(7), 7)).result(60) == "sent"
        assert (srv.received, srv.filled) == (3, 2)
        assert store.twins.twin_of(0) is None and _held(store, 0, 7)
        assert torch.equal(_backup(store, 0, 7)["model"]["w"], _state(7)["model"]["w"])
        assert client.list(srv.address)["backup"][0] == [3, 7]


@pytest.mark.timeout(120)
def test_the_inventory_at_a_stop_makes_the_newest_references_ordinary_shards(holder):
    """What a machine reports when its workers stopped lists the backups held by reference
    (made into files then), and a restore on another machine fetches them from it."""
    from stalwart.agent.ckpt import CkptManager
    store, srv, own = holder
    with MemCheckpointer(own, rank=0) as pusher, MemCheckpointer(store.shm_dir, rank=2) as twin, \
            PeerClient(timeout_s=30) as client:
        for step in range(5):
            _commit(twin, _state(step), step)
            assert client.push(srv.address, 0, step, _commit(pusher, _state(step), step)).result(60) == "sent"
        assert srv.filled == 5 and not os.listdir(store.backup_dir)
        mgr = CkptManager.__new__(CkptManager)   # (only its inventory: the store is this one)
        mgr.store = store
        inv = mgr.inventory()
        assert inv["own"] == {2: [3, 4]}
        assert inv["backup"] == {0: [3, 4]}      # the older references' slots were reused
        dest = os.path.join(os.path.dirname(store.backup_dir), "m2-restore")
        path = client.fetch(srv.address, 0, 4, dest)
        _, state = memckpt.load(path, 0)
        assert torch.equal(state["model"]["w"], _state(4)["model"]["w"])


@pytest.mark.timeout(120)
def test_an_offer_waits_for_its_twin_to_commit_the_step(holder):
    """Replicas finish a step within milliseconds of each other: an offer that arrives before its
    twin's commit waits for it (here as long as it takes) instead of sending the data."""
    store, srv, own = holder
    store.twins.wait_s = 60.0
    with MemCheckpointer(own, rank=0) as pusher, MemCheckpointer(store.shm_dir, rank=2) as twin, \
            PeerClient(timeout_s=90) as client:
        _commit(twin, _state(1), 1)
        assert client.push(srv.address, 0, 1, _commit(pusher, _state(1), 1)).result(60) == "sent"
        assert srv.filled == 1
        waiting = threading.Event()
        real_look = store.twins._look

        def look(fields, twin_rank):
            out = real_look(fields, twin_rank)
            waiting.set()
            return out
        store.twins._look = look               # (to know the offer is in; its result unchanged)
        fut = client.push(srv.address, 0, 2, _commit(pusher, _state(2), 2))
        assert waiting.wait(30)
        assert not fut.done()                  # held: the twin has not committed step 2
        _commit(twin, _state(2), 2)
        store.twins.changed()                  # what the agent does when a worker announces it
        assert fut.result(60) == "sent"
        assert (srv.received, srv.filled) == (2, 2)
        assert store.twins.virtual() == [(0, 1), (0, 2)]
        assert torch.equal(_backup(store, 0, 2)["model"]["w"], _state(2)["model"]["w"])


@pytest.mark.timeout(120)
def test_a_reference_whose_bytes_changed_is_dropped_and_an_older_holder_gets_puts(holder, monkeypatch):
    store, srv, own = holder
    with MemCheckpointer(own, rank=0) as pusher, MemCheckpointer(store.shm_dir, rank=2) as twin, \
            PeerClient(timeout_s=30) as client:
        src = _commit(twin, _state(5), 5)
        path = _commit(pusher, _state(5), 5)
        assert client.push(srv.address, 0, 5, path).result(60) == "sent"
        assert store.twins.virtual() == [(0, 5)]
        with open(memckpt.base_of(src) + ".data", "r+b") as f:   # its bytes changed under the header
            f.write(b"\xff" * 64)
        raw = memckpt.read_header_bytes(path)
        assert store.receiver.fill(raw, memckpt.header_fields(raw), src) is None
        assert client.list(srv.address)["backup"] == {}            # never a wrong backup

        # a holder of an older version, without offers: the pusher puts instead, from then on
        real = peerxfer._Handler._one

        def old_one(self, srv_, sock, req):
            if req.get("op") == "offer":
                raise ValueError("unknown op 'offer'")
            return real(self, srv_, sock, req)
        monkeypatch.setattr(peerxfer._Handler, "_one", old_one)
        _commit(twin, _state(6), 6)
        for step in (6, 7):
            assert client.push(srv.address, 0, step, _commit(pusher, _state(6), step)).result(60) == "sent"
        assert (srv.received, srv.filled) == (3, 1)
        assert client.list(srv.address)["backup"][0] == [6, 7]
        assert torch.equal(_backup(store, 0, 7)["model"]["w"], _state(6)["model"]["w"])


@pytest.mark.timeout(120)
def test_a_rank_whose_state_differs_from_its_replicas_stops_being_looked_up(holder):
    """Per-rank state (a data loader's position, say) makes every shard differ: after a few
    offers that found the step here with other bytes, the holder answers 'send' unseen."""
    from stalwart.agent import twins
    store, srv, own = holder
    looks = []
    real_look = store.twins._look
    store.twins._look = lambda fields, twin: looks.append(fields["step"]) or real_look(fields, twin)
    with MemCheckpointer(own, rank=0) as pusher, MemCheckpointer(store.shm_dir, rank=2) as twin, \
            PeerClient(timeout_s=30) as client:
        for step in range(twins.MISSES + 5):
            _commit(twin, _state(1000 + step), step)
            assert client.push(srv.address, 0, step, _commit(pusher, _state(step), step)).result(60) == "sent"
        assert srv.filled == 0
        assert looks == list(range(twins.MISSES))        # the later offers were not looked up
        assert client.list(srv.address)["backup"][0] == [twins.MISSES + 3, twins.MISSES + 4]


@pytest.mark.timeout(120)
def test_another_local_rank_ahead_of_the_replica_is_no_miss(holder):
    """Without a known twin, an offer that finds the step only at a local rank that is not the
    replica (the replica has not committed it yet) is sent, and counts as no miss."""
    store, srv, own = holder
    store.twins.expect([2, 3])                  # (what the agent says when its run starts)
    with MemCheckpointer(own, rank=0) as pusher, MemCheckpointer(store.shm_dir, rank=2) as twin, \
            MemCheckpointer(store.shm_dir, rank=3) as other, PeerClient(timeout_s=30) as client:
        for step in range(3):
            _commit(other, _state(500 + step), step)            # rank 3: never the same bytes
            assert client.push(srv.address, 0, step, _commit(pusher, _state(step), step)).result(60) == "sent"
        assert (srv.filled, store.twins._misses) == (0, {})
        _commit(other, _state(503), 3)
        _commit(twin, _state(3), 3)
        assert client.push(srv.address, 0, 3, _commit(pusher, _state(3), 3)).result(60) == "sent"
        assert srv.filled == 1 and store.twins.twin_of(0) == 2
