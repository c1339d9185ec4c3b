"""The checkpoint port refuses whoever does not hold the job's key, and a restore refuses a shard
that was not made with it: the hostile-client experiments of the data plane, each asserting the
refusal."""
from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import stat
import struct

import pytest
import torch

from stalwart.agent import paths, peerxfer
from stalwart.agent.ckpt import CkptManager
from stalwart.agent.peerxfer import PeerClient, PeerError
from stalwart.worker import memckpt
from stalwart.worker.memckpt import MemCheckpointer

KEY = bytes(range(32))
WRONG = bytes(range(1, 33))


@pytest.fixture
def pair(tmp_path):
    """Two agents' checkpoint managers of one job (a holds rank 0, b its backup)."""
    events: list = []
    a = CkptManager("mA", str(tmp_path / "a"), events.append, peer_host="127.0.0.1")
    b = CkptManager("mB", str(tmp_path / "b"), events.append, peer_host="127.0.0.1")
    durable = str(tmp_path / "durable")
    b.configure(None, every=2, backup=None, key=KEY)
    a.configure(durable, every=2, backup={"machine": "mB", "addr": list(b.peer_addr)}, key=KEY)
    try:
        yield a, b, events
    finally:
        a.close()
        b.close()


def _frame(sock, obj, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _answer(sock) -> dict:
    sock.settimeout(10)
    head = b""
    while len(head) < 4:
        got = sock.recv(4 - len(head))
        if not got:
            return {}
        head += got
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return json.loads(body)


def _snapshot(shm_dir: str, steps: int, key: bytes | None = KEY) -> None:
    with MemCheckpointer(shm_dir, 0, mac_key=key) as mem:
        for s in range(steps):
            mem.snapshot({"w": torch.full((64, 64), float(s)), "step": s}, s)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", [{"op": "list"}, {"op": "fetch", "rank": 0, "step": None, "tier": "own"},
                                {"op": "push", "header": {"nbytes": 4}}, {"op": "put", "hlen": 10}])
def test_an_unauthenticated_operation_is_refused(pair, op):
    a, b, _ = pair
    _snapshot(a.shm_dir, 1)
    with socket.create_connection(a.peer_addr, timeout=10) as s:
        _frame(s, op)
        reply = _answer(s)
        assert reply.get("ok") is False and "authentication required" in reply["error"]
        assert s.recv(1) == b""                         # and the connection is closed
    assert a.server.refused == 1 and a.server.received == 0


@pytest.mark.timeout(60)
def test_a_wrong_key_is_refused_both_ways(pair, tmp_path):
    a, b, _ = pair
    _snapshot(a.shm_dir, 1)
    with PeerClient(key=WRONG) as wrong:
        with pytest.raises(PeerError, match="key"):
            wrong.list(a.peer_addr)
        with pytest.raises(PeerError):
            wrong.fetch(a.peer_addr, 0, None, str(tmp_path / "stolen"), tier="own")
        path = memckpt.list_shards(a.shm_dir, 0)[-1][2]
        with pytest.raises(PeerError):
            wrong.push(b.peer_addr, 0, 0, path).result(timeout=30)
    assert not os.path.exists(tmp_path / "stolen") or not os.listdir(tmp_path / "stolen")
    assert b.server.received == 0 and a.server.refused >= 2 and b.server.refused >= 1
    # a server that is not the job's cannot pass for it either: the client checks the server's proof
    impostor = peerxfer.PeerServer("127.0.0.1", 0, b.store, key=WRONG).start()
    try:
        with PeerClient(key=KEY) as right, pytest.raises(PeerError, match="key"):
            right.list(impostor.address)
    finally:
        impostor.stop()
    with PeerClient(key=KEY) as right:                  # the job's key: served
        assert right.list(a.peer_addr)["own"] == {0: [0]}


@pytest.mark.timeout(30)
def test_a_huge_frame_before_authentication_is_refused_unread(pair):
    a, _, _ = pair
    with socket.create_connection(a.peer_addr, timeout=10) as s:
        s.sendall(struct.pack(">I", 1 << 30))           # claims a GiB; nothing more is sent
        reply = _answer(s)
        assert reply.get("ok") is False and "exceeds" in reply["error"]


@pytest.mark.timeout(30)
def test_the_server_listens_on_the_machines_address_only(pair):
    a, _, _ = pair
    assert a.server.address[0] == "127.0.0.1"


def _forge(dir: str, rank: int, step: int, meta: bytes, key: bytes | None) -> str:
    """A shard whose checksum is right (anyone can compute xxh3) but made with `key`."""
    data = torch.full((16,), 7.0).numpy().tobytes()
    table = [{"dtype": "float32", "shape": [16], "offset": 0, "nbytes": 64, "param": False,
              "requires_grad": False}]
    hdr = {"format": memckpt.FORMAT, "step": step, "rank": rank, "layout": {}, "nbytes": 64, "tensors": table,
           "meta": base64.b64encode(meta).decode()}
    if key is not None:
        table_json = json.dumps(table, separators=(",", ":"))
        mac = memckpt.mac_summer(key, memckpt.mac_prefix(rank, step, 64, "{}", table_json))
        mac.update(data)
        mac.update(meta)
        hdr.update(mac_alg=memckpt.MAC, mac=mac.hexdigest())
    hdr.update(hash=memckpt.HASH, complete=1)
    hdr["checksum"] = memckpt.checksum(hdr, data, meta)
    base = memckpt.step_base(dir, rank, step)
    os.makedirs(dir, exist_ok=True)
    with open(base + ".data", "wb") as f:
        f.write(data)
    memckpt.write_header(base, hdr)
    return base + ".hdr"



def _gadget_meta(marker: str) -> bytes:
    class Gadget:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    return pickle.dumps({"w": Gadget()}, protocol=5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forger_key", [None, WRONG], ids=["no-mac", "wrong-key"])
def test_a_forged_backup_is_not_restored_and_the_restore_falls_back(pair, tmp_path, forger_key):
    a, b, _ = pair
    _snapshot(a.shm_dir, 2)
    a.store.persist(0, 1).result(timeout=30)             # a genuine durable copy of step 1
    marker = tmp_path / "pwned"
    # what a holder without the key can do: put a shard of its own making where the backup is
    _forge(b.backup_dir, 0, 1, _gadget_meta(str(marker)), forger_key)
    cands = [{"tier": "backup", "step": 1, "holder": "mB", "addr": list(b.peer_addr)},
             {"tier": "durable", "step": 1}]
    tier, path, errors = a.materialize(0, cands)
    assert tier == "durable" and len(errors) == 1 and "MAC" in errors[0], errors
    step, state = memckpt.load(path, 0)
    assert step == 1 and torch.equal(state["w"], torch.full((64, 64), 1.0))
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_a_pickle_gadget_in_a_shard_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = _forge(str(tmp_path / "shards"), 0, 3, _gadget_meta(str(marker)), KEY)   # even with the key
    memckpt.verify_shard(path, KEY)
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        memckpt.load(path, 0)
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_the_durable_tier_loads_no_code(tmp_path):
    from stalwart.worker import durable
    marker = tmp_path / "pwned"
    durable.save(str(tmp_path / "ck"), 5, 0, {"w": torch.ones(2)})
    data_path, meta_path = durable.shard_paths(str(tmp_path / "ck"), 5, 0)
    import io
    import zlib
    buf = io.BytesIO()
    torch.save({"w": _Evil(str(marker))}, buf)
    with open(data_path, "wb") as f:
        f.write(buf.getvalue())
    with open(meta_path, "w") as f:
        json.dump({"step": 5, "rank": 0, "nbytes": len(buf.getvalue()),
                   "crc32": f"{zlib.crc32(buf.getvalue()):08x}", "layout": {}}, f)
    with pytest.raises(pickle.UnpicklingError):
        durable.load(str(tmp_path / "ck"), 5, 0)
    assert not marker.exists()


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.timeout(60)
def test_shards_and_the_key_are_private_files_in_a_private_directory(pair):
    a, b, _ = pair
    _snapshot(a.shm_dir, 2)
    assert a.client.flush(30)
    for d in (a.root, a.shm_dir, b.backup_dir):
        assert stat.S_IMODE(os.stat(d).st_mode) & 0o077 == 0, d
    files = [os.path.join(d, n) for d in (a.shm_dir, b.backup_dir) for n in os.listdir(d)]
    files.append(memckpt.key_path(a.shm_dir))
    assert len(files) > 3
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


@pytest.mark.timeout(30)
def test_a_planted_symlink_or_foreign_memory_directory_is_refused(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    work = tmp_path / "work"
    root = paths.ckpt_root(str(work), str(shm))
    os.symlink(str(tmp_path / "elsewhere"), root)        # planted before the agent starts
    with pytest.raises(paths.UnsafeDir, match="symlink"):
        paths.claim(str(work), str(shm))
    os.unlink(root)
    os.mkdir(root, 0o777)
    os.chmod(root, 0o777)
    assert paths.claim(str(work), str(shm)) == root      # its own: tightened
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    os.chown(root, 12345, -1)
    with pytest.raises(paths.UnsafeDir, match="uid 12345"):
        paths.claim(str(work), str(shm))


@pytest.mark.timeout(30)
def test_short_shared_memory_is_refused_before_a_slot_is_allocated(tmp_path, monkeypatch):
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_bavail, self.f_frsize = 10, st.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Small(real(p)))
    with MemCheckpointer(str(tmp_path / "own"), 0) as mem:
        with pytest.raises(memckpt.NoSpace, match="MiB are free"):
            mem.snapshot({"w": torch.ones(1 << 20)}, 0)
    assert not any(n.endswith(".data") for n in os.listdir(tmp_path / "own"))


@pytest.mark.timeout(60)
def test_an_agent_that_restarts_keeps_its_jobs_key_and_nobody_elses(tmp_path):
    root = str(tmp_path / "m")
    first = CkptManager("mA", root, lambda e: None, peer_host="127.0.0.1")
    first.configure(None, every=2, backup=None, key=KEY)
    first.close()
    again = CkptManager("mA", root, lambda e: None, peer_host="127.0.0.1")
    try:
        with PeerClient(key=KEY) as right:
            assert right.list(again.peer_addr)["backup"] == {}
        with PeerClient(key=WRONG) as wrong, pytest.raises(PeerError):
            wrong.list(again.peer_addr)
    finally:
        again.close()
    fresh = CkptManager("mB", str(tmp_path / "other"), lambda e: None, peer_host="127.0.0.1")
    try:                                                # no job yet: it serves nobody
        with PeerClient(key=KEY) as right, pytest.raises(PeerError):
            right.list(fresh.peer_addr)
    finally:
        fresh.close()
