"""Shard store tiers, peer streaming between two processes, and crash safety of the shm slots."""
from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import msgspec
import pytest
import torch

from stalwart.agent.peerxfer import PeerClient, PeerError
from stalwart.agent.shards import ShardStore
from stalwart.worker import memckpt
from stalwart.worker.memckpt import CorruptShard, MemCheckpointer


@pytest.fixture
def tmp_shm():
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="stalwart-test-shards-", dir=root)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _slot_bytes(path: str) -> bytes:
    hdr = memckpt.read_header(path)
    with open(memckpt.base_of(path) + ".data", "rb") as f:
        return f.read(hdr["nbytes"])


@pytest.fixture
def peer_server(tmp_shm):
    """A PeerServer in its own process (python -m stalwart.agent.peerxfer) on loopback."""
    backup = os.path.join(tmp_shm, "server-backup")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    proc = subprocess.Popen([sys.executable, "-m", "stalwart.agent.peerxfer", "--backup-dir", backup,
                             "--host", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE, env=env)
    try:
        deadline, line = time.monotonic() + 60, b""
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            r, _, _ = select.select([proc.stdout], [], [], 0.5)
            if r:
                line += os.read(proc.stdout.fileno(), 256)
            assert proc.poll() is None, "peer server exited early"
        assert line.startswith(b"listening "), f"no address from the server: {line!r}"
        _, host, port = line.split()
        yield (host.decode(), int(port)), backup
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


@pytest.mark.timeout(120)
def test_push_three_steps_newest_held_fetch_identical_corrupt_rejected(tmp_shm, peer_server):
    addr, server_backup = peer_server
    own = os.path.join(tmp_shm, "own")
    states = {}
    with MemCheckpointer(own, rank=3, layout={"tp": 1}) as ck, PeerClient(timeout_s=30) as client:
        w = torch.randn(5 << 20)                                   # 20 MiB shard
        for step in range(3):
            w.add_(1.0)
            states[step] = w.clone()
            ck.snapshot({"w": w, "step": step}, step)
            ck.wait()
            assert client.push(addr, 3, step, memckpt.latest(own, 3)[1]).result(timeout=60) == "sent"
        assert client.list(addr)["backup"][3] == [1, 2]           # newest kept (keep_backup=2)
        own_path = memckpt.latest(own, 3)[1]
        hdr, data = client.fetch_bytes(addr, 3)                    # newest
        assert hdr["step"] == 2 and bytes(data) == _slot_bytes(own_path)
        got = client.fetch(addr, 3, 1, os.path.join(tmp_shm, "restored"))
        step, state = memckpt.load(got, 3)
        assert step == 1 and torch.equal(state["w"], states[1]) and state["step"] == 1

        # a burst: pushes queued behind an in-flight one are coalesced, the newest is always sent
        futs = []
        for step in range(3, 6):
            w.add_(1.0)
            ck.snapshot({"w": w, "step": step}, step)
            ck.wait()
            futs.append(client.push(addr, 3, step, memckpt.latest(own, 3)[1]))
        results = [f.result(timeout=60) for f in futs]
        assert results[-1] == "sent" and set(results) <= {"sent", "superseded", "stale"}
        assert client.list(addr)["backup"][3][-1] == 5

        # a shard corrupted on the sender's side is rejected by the receiver and not kept
        bad_dir = os.path.join(tmp_shm, "bad")
        os.makedirs(bad_dir)
        src = memckpt.base_of(memckpt.latest(own, 3)[1])
        hdr = memckpt.read_header(src)
        hdr["step"] = 6
        bad = memckpt.step_base(bad_dir, 3, 6)
        shutil.copyfile(src + ".data", bad + ".data")
        memckpt.write_header(bad, hdr)
        _flip(bad + ".data", 7 << 20)
        with pytest.raises(PeerError, match="checksum"):
            client.push(addr, 3, 6, bad + ".hdr").result(timeout=60)
        assert 6 not in client.list(addr)["backup"][3]
        assert not [n for n in os.listdir(server_backup) if ".tmp." in n]   # no temp left behind
        with pytest.raises(PeerError):
            client.fetch_bytes(addr, 3, 6)


@pytest.mark.timeout(60)
def test_store_tiers_validation_persist_and_fallback(tmp_shm):
    own, backup = os.path.join(tmp_shm, "own"), os.path.join(tmp_shm, "backup")
    durable = os.path.join(tmp_shm, "durable")
    with MemCheckpointer(own, rank=0) as c0, MemCheckpointer(own, rank=1) as c1, \
            ShardStore(own, backup, durable, keep_backup=2, keep_durable=2) as store:
        for step in (7, 8):
            c0.snapshot({"w": torch.full((1 << 16,), float(step))}, step)
            c1.snapshot({"w": torch.full((1 << 10,), -float(step))}, step)
        c0.wait()
        c1.wait()
        assert store.steps("own") == {0: [7, 8], 1: [7, 8]}
        assert store.persist(0, 8).result(timeout=30).endswith("rank00000.step000000000008.hdr")
        store.persist(0, 7).result(timeout=30)
        # a peer's shard arrives in the backup tier
        hdr, view = memckpt.encode_shard(memckpt.latest(own, 1)[1])
        store.put_backup(dict(hdr, rank=9), [bytes(view)])
        view.release()
        with pytest.raises(CorruptShard):
            store.put_backup(dict(hdr, rank=9, step=99), [b"\x00" * hdr["nbytes"]])
        avail = store.available_steps()
        assert avail == {"own": {0: [7, 8], 1: [7, 8]}, "backup": {9: [8]}, "durable": {0: [7, 8]}}

        # corrupt own rank 0 step 8: it vanishes from the valid listing and restore falls back
        _flip(memckpt.slot_base(own, 0, 0) + ".data", 100)
        assert store.steps("own")[0] == [7]
        assert 8 in store.steps("own", verify=False)[0]
        tier, path = store.locate(0, 8)
        assert tier == "durable"
        assert torch.equal(memckpt.load(path, 0)[1]["w"], torch.full((1 << 16,), 8.0))
        _flip(os.path.join(durable, "rank00000.step000000000007.data"), 5)
        assert store.steps("durable") == {0: [8]}
        with pytest.raises(FileNotFoundError):
            store.locate(0, 6)
        with pytest.raises(ValueError):
            store.steps("cold")


@pytest.mark.timeout(60)
def test_persist_to_fsspec_url_and_keep_limit(tmp_shm):
    import fsspec
    url = f"memory://stalwart-test-{os.getpid()}-{time.monotonic_ns()}"
    own, backup = os.path.join(tmp_shm, "own"), os.path.join(tmp_shm, "backup")
    try:
        with MemCheckpointer(own, rank=2) as ck, ShardStore(own, backup, url, keep_durable=1) as store:
            for step in (1, 2):
                ck.snapshot({"w": torch.arange(1000) * step, "tag": f"s{step}"}, step)
                ck.wait()
                store.persist(2, step).result(timeout=30)
            assert store.steps("durable") == {2: [2]}                 # keep_durable=1 pruned step 1
            path = store.fetch(2, 2, "durable")                        # downloaded and verified
            step, state = memckpt.load(path, 2)
            assert step == 2 and state["tag"] == "s2" and torch.equal(state["w"], torch.arange(1000) * 2)
    finally:
        fs, root = fsspec.core.url_to_fs(url)
        if fs.exists(root):
            fs.rm(root, recursive=True)


_WRITER = r"""
import sys, torch
from stalwart.worker.memckpt import MemCheckpointer
ck = MemCheckpointer(sys.argv[1], rank=0)
state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(64)}     # 256 MiB
ck.snapshot(state, 0); ck.snapshot(state, 1); ck.wait()
print("ready", flush=True)
sys.stdin.readline()
while True:                                   # keep overwriting slot 0 until killed
    ck.snapshot({k: v + 1 for k, v in state.items()}, 2)
    ck.wait()
    ck.snapshot(state, 3)
    ck.snapshot(state, 4)
"""


@pytest.mark.timeout(120)
def test_killed_mid_copy_never_leaves_a_complete_looking_bad_slot(tmp_shm):
    d = os.path.join(tmp_shm, "slots")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        hdr0 = memckpt.slot_base(d, 0, 0) + ".hdr"
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 60
        while os.path.exists(hdr0) and time.monotonic() < deadline:
            pass                                # slot 0 is being rewritten once its header is gone
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        for slot in (0, 1):
            path = memckpt.slot_base(d, 0, slot) + ".hdr"
            if memckpt.read_header(path) is not None:    # whatever claims completeness is intact
                memckpt.verify_shard(path)
        step, path = memckpt.latest(d, 0)
        memckpt.load(path, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdin.close()
        proc.stdout.close()


@pytest.mark.timeout(60)
def test_a_durable_step_overwritten_before_its_copy_is_replaced_by_the_next_held_one(tmp_shm):
    """On a busy machine the writer can lap the durable copy: the slot of the chosen step already
    holds a later one. The durable tier then gets the oldest newer step still held, not nothing,
    and an earlier run's copy of the lapped step goes (the soak restored a NaN run's copy so)."""
    own, backup, durable = (os.path.join(tmp_shm, d) for d in ("own", "backup", "durable"))
    with MemCheckpointer(own, rank=0, slots=2) as ck, ShardStore(own, backup, durable) as store:
        # an earlier run's copy of step 1 (a NaN run: the next one restored from before it)
        ck.snapshot({"w": torch.full((256,), -1.0)}, 1)
        ck.wait()
        store.persist(0, 1).result(timeout=30)
        assert store.steps("durable") == {0: [1]}
        for step in range(4):                       # slots now hold steps 2 and 3
            ck.snapshot({"w": torch.full((256,), float(step))}, step)
        ck.wait()
        with pytest.raises(FileNotFoundError, match="rank 0 step 1"):
            store.persist(0, 1).result(timeout=30)
        url = store.persist(0, 1, or_newer=True).result(timeout=30)
        assert url.endswith("rank00000.step000000000002.hdr")
        assert torch.equal(memckpt.load(url, 0)[1]["w"], torch.full((256,), 2.0))
        # this run never replaces the earlier run's step 1: it must not pass for this run's
        assert store.steps("durable") == {0: [2]}
        with pytest.raises(FileNotFoundError, match="nor a newer one"):
            store.persist(0, 4, or_newer=True).result(timeout=30)


@contextlib.contextmanager
def hand_scanned(tmp_shm, **kw):
    """A CkptManager whose background watcher is stopped (the test scans by hand), its events."""
    from stalwart.agent.ckpt import CkptManager
    events: list = []
    mgr = CkptManager("m9", os.path.join(tmp_shm, "agent"), events.append, **kw)
    try:
        mgr._stop.set()
        mgr._thread.join(timeout=5)
        yield mgr, events
    finally:
        mgr.close()


def snapshot_and_scan(ck, mgr, steps) -> None:
    """Commit each step's snapshot, then let the manager see it and finish the durable copies it
    queued, one step at a time: a copy still queued when a later step reuses its slot would read
    that later step (the store then makes the newer step durable, as it should in a job, but not
    the step a test expects)."""
    for step in steps:
        ck.snapshot({"w": torch.full((64,), float(step))}, step)
        ck.wait()
        mgr._scan()
        mgr.store.drain()


@pytest.mark.timeout(60)
def test_a_durable_step_the_watcher_saw_late_is_still_persisted(tmp_shm):
    """Steps 0-3 land in the slots between two scans: step 1 and 3 (every=2) must both be made
    durable, not only the newest step; only the newest goes to the backup peer."""
    with hand_scanned(tmp_shm) as (mgr, events):
        durable = os.path.join(tmp_shm, "durable")
        mgr.configure(durable, every=2, backup=None)
        with MemCheckpointer(mgr.shm_dir, rank=0, slots=4) as ck:
            for step in range(4):
                ck.snapshot({"w": torch.full((64,), float(step))}, step)
            ck.wait()
        mgr._scan()
        mgr.store.close()                # waits for the background persists
        mgr._scan()                      # nothing new: nothing repeated
        durable_steps = sorted(e.step for e in events if e.tier == "durable")
        assert durable_steps == [1, 3], events
        assert [e.step for e in events if e.tier == "own"] == [3]
        assert [s for _, s, _ in memckpt.list_shards(durable, 0)] == [1, 3]


@pytest.mark.timeout(60)
def test_a_run_that_goes_back_announces_its_steps_again(tmp_shm):
    """A run restored from step 1 after a run that reached step 5: the old run's slots of steps
    2-5 go (stale copies), and the new run's steps 2, 3... are announced and persisted although
    the manager had seen 5 (they were silently ignored, so every restore fell back to durable)."""
    with hand_scanned(tmp_shm) as (mgr, events):
        durable = os.path.join(tmp_shm, "durable")
        mgr.configure(durable, every=2, backup=None)
        with MemCheckpointer(mgr.shm_dir, rank=0, slots=2) as ck:
            snapshot_and_scan(ck, mgr, range(6))
        assert [s for _, s, _ in memckpt.list_shards(mgr.shm_dir, 0)] == [4, 5]
        mgr.store.drain()       # the first run's durable copies are reported before we look away
        events.clear()
        mgr.configure(durable, every=2, backup=None)          # the next run, restored from step 1
        mgr.start_from(0, 1)
        assert memckpt.list_shards(mgr.shm_dir, 0) == []      # the stopped run's 4 and 5 are gone
        mgr._scan()
        assert events == []                                   # nothing stale announced
        with MemCheckpointer(mgr.shm_dir, rank=0, slots=2) as ck:
            for step in (2, 3):
                ck.snapshot({"w": torch.full((64,), 10.0 + step)}, step)
                ck.wait()
                mgr._scan()
        mgr.store.close()
        assert [(e.tier, e.step) for e in events if e.tier == "own"] == [("own", 2), ("own", 3)]
        assert [e.step for e in events if e.tier == "durable"] == [3]
        assert torch.equal(memckpt.load(durable, 0, 3)[1]["w"], torch.full((64,), 13.0))


@pytest.mark.timeout(120)
def test_backups_arrive_in_recycled_files_and_a_torn_send_is_dropped(tmp_shm, monkeypatch):
    """The receiver keeps pruned steps' data files for the next ones (their pages exist: no new
    file per step), a push whose slot changed while it was sent is dropped by the peer, and a
    client speaking the older `push` op (a header object) is still served."""
    import socket

    from stalwart.agent import peerxfer
    from stalwart.agent.peerxfer import PeerServer

    own = os.path.join(tmp_shm, "own")
    store = ShardStore(os.path.join(tmp_shm, "srv-own"), os.path.join(tmp_shm, "srv-backup"), keep_backup=2)
    srv = PeerServer("127.0.0.1", 0, store).start()
    try:
        with MemCheckpointer(own, rank=1, slots=2) as ck, PeerClient(timeout_s=30) as client:
            w = torch.zeros(1 << 18)
            inodes = []
            for step in range(8):
                w.add_(1.0)
                ck.snapshot({"w": w}, step)
                ck.wait()
                assert client.push(srv.address, 1, step, memckpt.latest(own, 1)[1]).result(timeout=60) == "sent"
                inodes.append(os.stat(memckpt.step_base(store.backup_dir, 1, step) + ".data").st_ino)
            assert client.list(srv.address)["backup"][1] == [6, 7]
            data_files = [n for n in os.listdir(store.backup_dir) if n.endswith(".data") or ".spare." in n]
            assert len(data_files) <= 3, data_files            # two held, one recycled for the next
            assert len(set(inodes)) <= 3, inodes               # the same files, again and again
            _, state = memckpt.load(store.fetch(1, 7, "backup"), 1)
            assert torch.equal(state["w"], w)

            # the worker overwrote the slot while it went out: the peer drops it
            w.add_(1.0)
            ck.snapshot({"w": w}, 8)
            ck.wait()
            monkeypatch.setattr(peerxfer.memckpt, "still_current_raw", lambda path, raw: False)
            assert client.push(srv.address, 1, 8, memckpt.latest(own, 1)[1]).result(timeout=60) == "stale"
            monkeypatch.undo()
            assert client.list(srv.address)["backup"][1] == [6, 7]

            # the older op: the header as an object, then the bytes
            path = memckpt.latest(own, 1)[1]
            hdr = memckpt.read_header(path)
            with socket.create_connection(srv.address, timeout=30) as sock:
                peerxfer._send_frame(sock, {"op": "push", "header": hdr})
                with open(memckpt.base_of(path) + ".data", "rb") as f:
                    sock.sendall(f.read(hdr["nbytes"]))
                assert peerxfer._recv_frame(sock)["ok"]
            assert client.list(srv.address)["backup"][1] == [7, 8]
    finally:
        srv.stop()
        store.close()


def test_header_fields_without_parsing_agree_with_json(tmp_shm):
    import json

    with MemCheckpointer(tmp_shm, rank=2) as ck:
        ck.snapshot({"a": torch.arange(10.0), "b": [1, "x"]}, 41)
    path = memckpt.latest(tmp_shm, 2)[1]
    raw = memckpt.read_header_bytes(path)
    hdr = json.loads(raw)
    fields = memckpt.header_fields(raw)
    assert {k: fields[k] for k in ("step", "rank", "nbytes", "checksum", "hash")} == \
        {k: hdr[k] for k in ("step", "rank", "nbytes", "checksum", "hash")}
    assert fields["meta"] == memckpt.meta_bytes(hdr) and hdr["hash"] == memckpt.HASH
    # a header laid out otherwise (written by hand, or before `hash`: CRC32) is parsed instead
    other = json.dumps({k: hdr[k] for k in reversed(list(hdr))}).encode()
    assert memckpt.header_fields(other)["checksum"] == hdr["checksum"]
    with pytest.raises(CorruptShard):
        memckpt.header_fields(b'{"format": "x"}')


@pytest.mark.timeout(60)
def test_memory_copies_are_reported_at_most_once_a_period_and_a_new_run_at_once(tmp_shm):
    """The agent reports a rank's memory copies to the controller at most once a period (the
    controller plans restores from the stopped machines' inventories); durable copies are all
    reported; the newest report held back goes when the workers stop; a new run's first copy is
    reported at once."""
    with hand_scanned(tmp_shm, announce_every_s=3600.0) as (mgr, events):
        durable = os.path.join(tmp_shm, "durable")
        mgr.configure(durable, every=2, backup=None)
        with MemCheckpointer(mgr.shm_dir, rank=0, slots=2) as ck:
            snapshot_and_scan(ck, mgr, range(4))
            mgr.store.drain()
            assert [e.step for e in events if e.tier == "own"] == [0]
            assert sorted(e.step for e in events if e.tier == "durable") == [1, 3]
            assert mgr.inventory()["own"] == {0: [2, 3]}            # what a `stopped` report lists
            mgr.workers_stopped()                                  # the newest held back goes now
            assert [e.step for e in events if e.tier == "own"] == [0, 3]
            mgr.configure(durable, every=2, backup=None)           # the next run
            snapshot_and_scan(ck, mgr, (4, 5))
        assert [e.step for e in events if e.tier == "own"] == [0, 3, 4]
        mgr.workers_stopped()
        assert [e.step for e in events if e.tier == "own"] == [0, 3, 4, 5]


@pytest.mark.timeout(60)
def test_a_replay_run_leaves_the_jobs_memory_copies_alone(tmp_shm):
    """The soak found it: a dual-phase replay on this machine started its throw-away rank 0 "from
    scratch", which removed the job's rank 0 copies here as a new run's later steps; the restart
    after the replay then failed to restore the step the controller had planned from them."""
    from stalwart import protocol as p
    spec = p.RunSpec(job=1, run=7, command=["python", "-m", "job"], cwd=None, user_env={},
                     layout=p.Layout(machines=1, gpus_per_machine=1, dp=1), steps=30, ckpt_every=10,
                     ckpt_dir="/ck", mem_slots=2, replay=True)
    with hand_scanned(tmp_shm) as (mgr, events):
        ck = MemCheckpointer(mgr.shm_dir, 0)
        snapshot_and_scan(ck, mgr, [4, 5])
        ck.close()
        held = memckpt.list_shards(mgr.shm_dir, 0)
        assert [s for _, s, _ in held] == [4, 5]
        extra = mgr.prepare_run(p.Start(spec=spec, workers=[p.WorkerSlot(rank=0, local_rank=0, group_rank=0)]),
                                events.append)
        assert extra is not None and extra[0]["RANK"] == "0"
        assert memckpt.list_shards(mgr.shm_dir, 0) == held
        # the job's own run from scratch does start over
        job = msgspec.structs.replace(spec, replay=False, run=8)
        mgr.prepare_run(p.Start(spec=job, workers=[p.WorkerSlot(rank=0, local_rank=0, group_rank=0)]),
                        events.append)
        assert memckpt.list_shards(mgr.shm_dir, 0) == []


@pytest.mark.timeout(60)
def test_paced_backups_push_the_grid_and_a_stop_flushes_the_newest(tmp_shm):
    """At a pace of 2 the peer gets steps 1 and 3 of 0-4 (each push's CPU measured); when the
    workers stop, the deferred step 4 is pushed and waited for, so the holder's inventory has it."""
    from stalwart.agent.ckpt import CkptManager
    holder = CkptManager("m8", os.path.join(tmp_shm, "holder"), lambda ev: None)
    try:
        key = os.urandom(memckpt.KEY_BYTES)
        holder.configure(None, every=10, backup=None, key=key)
        with hand_scanned(tmp_shm) as (mgr, events):
            mgr.configure(None, every=10, backup={"machine": "m8", "addr": list(holder.peer_addr)},
                          key=key, backup_every=2, mem_slots=4)
            with MemCheckpointer(mgr.shm_dir, rank=0, slots=4) as ck:
                for step in range(5):
                    ck.snapshot({"w": torch.full((64,), float(step))}, step)
                    ck.wait()
                    mgr._scan()
                    assert mgr.client.flush(10)
            assert holder.inventory()["backup"] == {0: [1, 3]}
            assert mgr._lanes[0].cost_s is not None and mgr._lanes[0].cost_s > 0
            mgr.workers_stopped()
            assert holder.inventory()["backup"] == {0: [1, 3, 4]}
            mgr.workers_stopped()                  # nothing deferred any more: nothing pushed again
            assert mgr.client.flush(10) and holder.inventory()["backup"] == {0: [1, 3, 4]}
    finally:
        holder.close()
