"""MemCheckpointer: bit-exact round trip, double buffering, interrupted writes, corruption."""
from __future__ import annotations

import time
import copy
import json
import os
import random
import shutil
import tempfile
import threading

import numpy as np
import pytest
import torch

from stalwart.worker import memckpt
from stalwart.worker.memckpt import CorruptShard, MemCheckpointer, latest, load


@pytest.fixture
def shm_dir():
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="stalwart-test-memckpt-", dir=root)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 50))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model, opt, gen):
    x = torch.randint(0, 50, (8,), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(x), x)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _state(model, opt, gen, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "rng": {"torch": torch.get_rng_state(), "gen": gen.get_state(), "py": random.getstate(),
                    "np": np.random.get_state()},
            "blob": b"\x00\x01opaque", "lr": 1e-2}


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert a.layout == b.layout and a.requires_grad == b.requires_grad
        assert torch.equal(a.to_dense(), b.to_dense()) if a.is_sparse else torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


@pytest.mark.timeout(30)
def test_round_trip_is_bit_exact_and_training_continues_identically(shm_dir):
    model, opt = _model_and_opt()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        _train_step(model, opt, gen)
    state = _state(model, opt, gen, 3)
    with MemCheckpointer(shm_dir, rank=5, layout={"tp": 2, "pp": 1, "dp": 4}) as ck:
        ck.snapshot(state, 3)
        ck.wait()
    step, restored = load(shm_dir, 5)
    assert step == 3
    _assert_same(state, restored)
    assert restored["model"]._metadata == state["model"]._metadata     # load_state_dict versioning kept
    # continue from the restored copy: the next step is bit-identical to the original's
    model2, opt2 = _model_and_opt(seed=99)
    model2.load_state_dict(restored["model"])
    opt2.load_state_dict(restored["optim"])
    gen2 = torch.Generator()
    gen2.set_state(restored["rng"]["gen"])
    assert torch.equal(_train_step(model, opt, gen), _train_step(model2, opt2, gen2))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.timeout(30)
def test_odd_tensors_dtypes_views_and_shared_tensors(shm_dir):
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    shared = torch.randn(5)
    state = {"bf16": torch.randn(7, 3).to(torch.bfloat16), "bool": torch.tensor([True, False, True]),
             "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4), "i8": torch.arange(-5, 5, dtype=torch.int8),
             "noncontig": base.t()[1:, ::2], "a": shared, "b": shared, "cplx": torch.randn(3, dtype=torch.cfloat),
             "param": torch.nn.Parameter(torch.ones(2, 2)), "sparse": torch.eye(3).to_sparse()}
    with MemCheckpointer(shm_dir, rank=0) as ck:
        ck.snapshot(state, 0)
    _, out = load(shm_dir, 0)
    for k in ("bf16", "bool", "scalar", "empty", "i8", "noncontig", "a", "cplx"):
        assert out[k].dtype == state[k].dtype and torch.equal(out[k], state[k]), k
    assert out["a"] is out["b"]                       # one tensor referenced twice stays one tensor
    assert isinstance(out["param"], torch.nn.Parameter) and out["param"].requires_grad
    assert torch.equal(out["sparse"].to_dense(), torch.eye(3))
    out["a"].add_(1)                                  # restored tensors own their memory
    assert not torch.equal(out["a"], state["a"])


@pytest.mark.timeout(30)
def test_a_state_that_gains_a_sparse_tensor_later_is_still_copied_right(shm_dir):
    # the snapshot takes every tensor without testing its layout while its plan holds, and tests
    # them when the state changes shape: a tensor that is not dense goes into the pickle instead
    dense = {"w": torch.randn(4, 4), "n": 3}
    with MemCheckpointer(shm_dir, rank=0, slots=2) as ck:
        ck.snapshot(dense, 0)
        ck.snapshot(dense, 1)
        later = {"w": torch.randn(4, 4), "n": 4, "s": torch.eye(4).to_sparse()}
        ck.snapshot(later, 2)
        ck.snapshot(later, 3)
    step, out = load(shm_dir, 0)
    assert step == 3 and out["n"] == 4 and torch.equal(out["w"], later["w"])
    assert out["s"].is_sparse and torch.equal(out["s"].to_dense(), torch.eye(4))


@pytest.mark.timeout(30)
def test_double_buffering_alternates_slots(shm_dir):
    with MemCheckpointer(shm_dir, rank=2) as ck:
        for step in range(3):
            ck.snapshot({"w": torch.full((1000,), float(step))}, step)
            ck.wait()
            assert latest(shm_dir, 2)[0] == step
        hdr0 = memckpt.read_header(memckpt.slot_base(shm_dir, 2, 0))
        hdr1 = memckpt.read_header(memckpt.slot_base(shm_dir, 2, 1))
        assert (hdr0["step"], hdr1["step"]) == (2, 1)
        assert load(shm_dir, 2, step=1)[1]["w"][0].item() == 1.0
        assert load(shm_dir, 2)[1]["w"][0].item() == 2.0
        with pytest.raises(FileNotFoundError):
            load(shm_dir, 2, step=0)                  # overwritten by step 2
        assert latest(shm_dir, 3) is None


@pytest.mark.timeout(30)
def test_more_slots_keep_more_recent_steps(shm_dir):
    with MemCheckpointer(shm_dir, rank=1, slots=4) as ck:
        for step in range(6):
            ck.snapshot({"w": torch.full((100,), float(step))}, step)
        ck.wait()
        assert [s for _, s, _ in memckpt.list_shards(shm_dir, 1)] == [2, 3, 4, 5]
        assert memckpt.parse_name("rank00001.slot3.hdr") == (1, "slot", 3)
        assert load(shm_dir, 1, step=2)[1]["w"][0].item() == 2.0
        with pytest.raises(FileNotFoundError):
            load(shm_dir, 1, step=1)                  # overwritten by step 5
    for bad in (1, 0, 1000, True, 2.0):
        with pytest.raises(ValueError, match="slots"):
            MemCheckpointer(shm_dir, rank=1, slots=bad)


@pytest.mark.timeout(30)
def test_interrupted_write_never_appears_complete(shm_dir, monkeypatch):
    state = {f"t{i}": torch.full((256,), float(i)) for i in range(8)}
    with MemCheckpointer(shm_dir, rank=0) as ck:
        ck.snapshot(state, 0)
        ck.snapshot(state, 1)
        ck.wait()
        def crashing_copy(dst, src):         # the process "dies" after 3 tensors of step 2
            for d, t in zip(dst[:3], src[:3]):
                d.copy_(t)
            raise KeyboardInterrupt("simulated crash mid-copy")

        monkeypatch.setattr(torch, "_foreach_copy_", crashing_copy)
        with pytest.raises(KeyboardInterrupt):
            ck.snapshot({k: v + 100 for k, v in state.items()}, 2)
        monkeypatch.undo()
        assert memckpt.read_header(memckpt.slot_base(shm_dir, 0, 0)) is None   # slot 0 half written
        assert latest(shm_dir, 0)[0] == 1
        assert torch.equal(load(shm_dir, 0)[1]["t7"], state["t7"])
        ck.snapshot(state, 2)                          # the checkpointer recovers on the next step
        ck.wait()
        assert latest(shm_dir, 0)[0] == 2


@pytest.mark.timeout(30)
def test_flipped_byte_raises_corrupt_shard(shm_dir):
    with MemCheckpointer(shm_dir, rank=1) as ck:
        ck.snapshot({"w": torch.randn(4096), "n": 7}, 10)
    step, path = latest(shm_dir, 1)
    assert step == 10 and memckpt.verify_shard(path)["step"] == 10
    data = memckpt.base_of(path) + ".data"
    with open(data, "r+b") as f:
        f.seek(1234)
        b = f.read(1)
        f.seek(1234)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptShard):
        load(shm_dir, 1)
    with pytest.raises(CorruptShard):
        memckpt.verify_shard(path)
    with open(data, "r+b") as f:                       # restore the byte, then corrupt the metadata instead
        f.seek(1234)
        f.write(b)
    load(shm_dir, 1)
    hdr = memckpt.read_header(path)
    meta = bytearray(memckpt.meta_bytes(hdr))
    meta[-3] ^= 0x01
    hdr["meta"] = __import__("base64").b64encode(bytes(meta)).decode()
    memckpt.write_header(memckpt.base_of(path), hdr)
    with pytest.raises(CorruptShard):
        load(path, 1)


@pytest.mark.timeout(30)
def test_truncated_data_and_bad_input(shm_dir):
    with MemCheckpointer(shm_dir, rank=0) as ck:
        with pytest.raises(ValueError):
            ck.snapshot({"w": torch.zeros(3)}, -1)
        with pytest.raises(ValueError):
            ck.snapshot({"f": lambda: 0}, 0)
        ck.snapshot({"w": torch.zeros(1 << 16)}, 0)
    path = latest(shm_dir, 0)[1]
    os.truncate(memckpt.base_of(path) + ".data", 1000)
    with pytest.raises(CorruptShard):
        load(path, 0)
    with pytest.raises(ValueError):
        MemCheckpointer(shm_dir, rank=-1)


@pytest.mark.timeout(30)
def test_slot_grows_and_header_is_json(shm_dir):
    with MemCheckpointer(shm_dir, rank=0) as ck:
        ck.snapshot({"w": torch.ones(10)}, 0)
        ck.snapshot({"w": torch.ones(100000)}, 2)     # same slot, larger: reallocated
        ck.wait()
    _, path = latest(shm_dir, 0)
    with open(path) as f:
        hdr = json.load(f)
    assert hdr["complete"] == 1 and hdr["step"] == 2 and hdr["nbytes"] >= 400000
    assert torch.equal(load(path, 0)[1]["w"], torch.ones(100000))
    hdr_view, view = memckpt.encode_shard(path)
    assert len(view) == hdr_view["nbytes"] and memckpt.still_current(path, hdr_view)
    view.release()


def test_prune_keeps_the_newest_steps_of_one_rank_by_name(tmp_path):
    from stalwart.agent.shards import prune
    for rank, step in [(0, 5), (0, 12), (0, 7), (1, 3), (0, 100)]:
        base = memckpt.step_base(str(tmp_path), rank, step)
        for ext in (".data", ".hdr"):
            open(base + ext, "w").close()
    open(memckpt.slot_base(str(tmp_path), 0, 0) + ".hdr", "w").close()        # own slots: not steps
    open(memckpt.step_base(str(tmp_path), 0, 1) + ".data", "w").close()       # no header: not a shard
    assert [s for s, _ in memckpt.step_shards(str(tmp_path), 0)] == [5, 7, 12, 100]
    prune(str(tmp_path), 0, keep=2)
    assert [s for s, _ in memckpt.step_shards(str(tmp_path), 0)] == [12, 100]
    assert not os.path.exists(memckpt.step_base(str(tmp_path), 0, 5) + ".data")
    assert [s for s, _ in memckpt.step_shards(str(tmp_path), 1)] == [3]
    assert memckpt.step_shards(str(tmp_path / "none"), 0) == []


def test_header_step_rank_and_raw_seqlock_without_parsing(shm_dir):
    """The agent's cheap reads of a slot: (step, rank) from the header's first bytes, and 'not
    overwritten' as the same header bytes before and after a copy."""
    with MemCheckpointer(shm_dir, rank=7, slots=2) as ck:
        ck.snapshot({"w": torch.ones(4), "lr": 0.5}, 3)
        ck.wait()
        path = latest(shm_dir, 7)[1]
        assert memckpt.header_step_rank(path) == (3, 7)
        hdr, raw, view = memckpt.encode_shard_raw(path)
        view.release()
        assert json.loads(raw) == hdr and memckpt.still_current_raw(path, raw)
        ck.snapshot({"w": torch.ones(4), "lr": 0.5}, 5)          # the same slot, a newer step
        ck.wait()
        assert memckpt.header_step_rank(path) == (5, 7) and not memckpt.still_current_raw(path, raw)
    other = os.path.join(shm_dir, "rank00001.slot0")                # a header laid out otherwise
    memckpt.write_header(other, {"rank": 1, "step": 9, "format": memckpt.FORMAT, "complete": 1})
    assert memckpt.header_step_rank(other + ".hdr") == (9, 1)
    assert memckpt.header_step_rank(os.path.join(shm_dir, "rank00002.slot0.hdr")) is None


def test_a_shard_whose_metadata_uses_persistent_ids_still_loads(shm_dir):
    """Shards written before tensors were pickled as global references (persistent ids)."""
    import base64
    import io
    import pickle
    import zlib

    class OldPickler(pickle.Pickler):
        def __init__(self, buf):
            super().__init__(buf, protocol=5)
            self.tensors = []

        def persistent_id(self, obj):
            if isinstance(obj, torch.Tensor):
                self.tensors.append(obj)
                return ("t", len(self.tensors) - 1)
            return None

    w = torch.arange(6, dtype=torch.float32)
    buf = io.BytesIO()
    p = OldPickler(buf)
    p.dump({"w": w, "step": 4})
    meta = buf.getvalue()
    data = w.numpy().tobytes()
    base = memckpt.step_base(shm_dir, 0, 4)
    with open(base + ".data", "wb") as f:
        f.write(data)
    table = [{"dtype": "float32", "shape": [6], "offset": 0, "nbytes": len(data), "param": False,
              "requires_grad": False}]
    memckpt.write_header(base, {"format": memckpt.FORMAT, "step": 4, "rank": 0, "layout": {},
                                "nbytes": len(data), "tensors": table,
                                "meta": base64.b64encode(meta).decode(), "complete": 1,
                                "checksum": zlib.crc32(meta, zlib.crc32(data))})
    step, state = load(base + ".hdr", 0)
    assert step == 4 and state["step"] == 4 and torch.equal(state["w"], w)


def test_a_shard_summed_with_crc32_before_xxh3_still_loads_and_verifies(shm_dir):
    import zlib

    import torch
    state = {"w": torch.arange(100.0), "n": 3}
    with memckpt.MemCheckpointer(shm_dir, 0) as ck:
        ck.snapshot(state, 5)
    path = memckpt.latest(shm_dir, 0)[1]
    hdr = memckpt.read_header(path)
    assert hdr["hash"] == memckpt.HASH
    with open(memckpt.base_of(path) + ".data", "rb") as f:
        data = f.read(hdr["nbytes"])
    del hdr["hash"]                                   # as written before the hash was named
    hdr["checksum"] = zlib.crc32(memckpt.meta_bytes(hdr), zlib.crc32(data))
    memckpt.write_header(memckpt.base_of(path), hdr)
    memckpt.verify_shard(path)
    step, got = memckpt.load(path, 0)
    assert step == 5 and torch.equal(got["w"], state["w"]) and got["n"] == 3
    hdr["checksum"] ^= 1
    memckpt.write_header(memckpt.base_of(path), hdr)
    with pytest.raises(memckpt.CorruptShard):
        memckpt.load(path, 0)


def _held(m: MemCheckpointer) -> threading.Event:
    """Hold the copier thread (an overlapped copy waits behind this) until the event is set."""
    gate = threading.Event()
    m._copier.submit(gate.wait)
    return gate


def test_overlapped_copies_hold_the_state_handed_over_once_fenced(shm_dir):
    model, opt = _model_and_opt()
    gen = torch.Generator().manual_seed(1)
    with MemCheckpointer(shm_dir, rank=0, overlap=True) as m:
        for step in range(4):
            _train_step(model, opt, gen)
            expected = copy.deepcopy(_state(model, opt, gen, step))
            gate = _held(m)
            m.snapshot(_state(model, opt, gen, step), step)
            assert latest(shm_dir, 0) is None or latest(shm_dir, 0)[0] < step   # not copied yet
            gate.set()
            m.fence()           # (what on_gradients does before the optimizer step)
            m.wait()
            assert m.overlap_off is None
            got_step, got = load(shm_dir, 0)
            assert got_step == step
            _assert_same(expected, got)


def test_a_tensor_changed_before_its_overlapped_copy_drops_that_step_and_copies_block_after(shm_dir):
    model, opt = _model_and_opt()
    gen = torch.Generator().manual_seed(1)
    with MemCheckpointer(shm_dir, rank=0, overlap=True) as m:
        _train_step(model, opt, gen)
        m.snapshot(_state(model, opt, gen, 0), 0)
        m.fence()
        m.wait()
        gate = _held(m)
        m.snapshot(_state(model, opt, gen, 1), 1)
        _train_step(model, opt, gen)      # the optimizer step before the fence: the copy would be torn
        gate.set()
        m.wait()
        assert m.overlap_off is not None and "step 1" in m.overlap_off
        assert latest(shm_dir, 0)[0] == 0           # step 1 was never committed; step 0 stands
        expected = copy.deepcopy(_state(model, opt, gen, 2))
        m.snapshot(_state(model, opt, gen, 2), 2)   # copied in the call now...
        _train_step(model, opt, gen)                 # ...so no fence is needed before this
        m.wait()
        got_step, got = load(shm_dir, 0)
        assert got_step == 2
        _assert_same(expected, got)


def test_an_inference_tensor_in_the_state_is_copied_on_the_training_thread(shm_dir):
    with torch.inference_mode():
        t = torch.arange(8.0)
    with MemCheckpointer(shm_dir, rank=0, overlap=True) as m:
        m.snapshot({"t": t}, 0)
        m.wait()
        assert m.overlap_off is not None and "version counter" in m.overlap_off
        assert torch.equal(load(shm_dir, 0)[1]["t"], t)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("change", ["broadcast", "dtype", "requires_grad", "sparse", "no_fit"])
def test_a_tensor_that_changes_shape_dtype_or_layout_is_planned_again(shm_dir, change, overlap):
    # the same number of tensors, one of them changed: a copy into the old plan would cast,
    # broadcast or fail; every step's shard holds that step's state exactly
    w = torch.arange(16.0).reshape(4, 4)
    new = {"broadcast": torch.full((1, 4), 7.0), "dtype": torch.arange(16.0, dtype=torch.float64).reshape(4, 4),
           "requires_grad": torch.arange(16.0).reshape(4, 4).requires_grad_(),
           "sparse": torch.eye(4).to_sparse(), "no_fit": torch.arange(5.0)}[change]
    states = {s: {"w": w + s, "u": torch.ones(3) * s, "step": s} for s in range(3)}
    states.update({s: {"w": new, "u": torch.ones(3) * s, "step": s} for s in range(3, 6)})
    with MemCheckpointer(shm_dir, rank=0, slots=2, overlap=overlap) as m:
        for s in range(6):
            m.snapshot(states[s], s)
            m.fence()
            m.wait()
            got_step, got = load(shm_dir, 0)
            assert got_step == s
            _assert_same(states[s], got)


@pytest.mark.timeout(30)
def test_a_state_whose_shapes_change_every_step_is_copied_right_every_step(shm_dir):
    with MemCheckpointer(shm_dir, rank=0, slots=2) as m:
        for s in range(10):
            state = {"x": torch.arange(float(s % 3 + 1)).expand(2, s % 3 + 1).contiguous()}
            m.snapshot(state, s)
            m.wait()
            got_step, got = load(shm_dir, 0)
            assert got_step == s
            _assert_same(state, got)


def test_a_slots_commit_the_commit_thread_has_not_started_is_done_by_the_snapshot_that_needs_it(shm_dir):
    """A busy host can keep the nice-19 commit thread from running for many steps; the snapshot
    that reuses a slot then commits the slot's earlier step itself instead of waiting behind it,
    and the other slots' too, so that memory always keeps a complete step; every commit is still
    announced once, in step order."""
    committed: list[int] = []
    m = MemCheckpointer(shm_dir, 0, slots=2, on_commit=lambda step, path: committed.append(step))
    release, expired = threading.Event(), threading.Event()

    def hold() -> None:                       # the commit thread, held (as the OS may hold it)
        if not release.wait(30):
            expired.set()

    m._pool.submit(hold)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    try:
        for step in range(3):                 # step 2 reuses step 0's slot, whose commit is queued
            state["w"].add_(1)
            m.snapshot(state, step)
        assert not expired.is_set()           # the snapshot did not wait for the held thread
        # steps 0 and 1 were committed here, not on the held thread; step 2 is being written over
        # step 0, and step 1 stays in memory, complete, for a rank killed now to restore
        assert committed == [0, 1], committed
        assert latest(shm_dir, 0)[0] == 1
    finally:
        release.set()
        m.wait()
        m.close()
    assert committed == [0, 1, 2]
    step, path = latest(shm_dir, 0)
    assert step == 2 and torch.equal(load(shm_dir, 0, 2)[1]["w"], state["w"])


def test_the_commit_thread_runs_hand_offs_in_order_and_finishes_them_at_shutdown():
    from stalwart.worker.commits import CommitThread
    ran: list[int] = []
    t = CommitThread("test-commit")
    futs = [t.submit(ran.append, i) for i in range(5)]
    skipped = t.submit(ran.append, 99)
    assert skipped.cancel() or skipped.done()          # (cancelled unless it already ran)
    failing = t.submit(lambda: 1 / 0)
    last = t.submit(ran.append, 5)
    t.shutdown(wait=True)                              # what was handed over runs before it stops
    assert all(f.done() for f in futs + [failing, last])
    assert [x for x in ran if x != 99] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ZeroDivisionError):
        failing.result()


def test_an_idle_commit_thread_sleeps_until_the_next_hand_off_wakes_it():
    from stalwart.worker.commits import CommitThread
    t = CommitThread("test-commit-idle")
    try:
        assert t.submit(lambda: 1).result(timeout=5) == 1
        deadline = time.monotonic() + 10
        while not t._asleep and time.monotonic() < deadline:        # after 100 ms without work
            time.sleep(0.01)
        assert t._asleep
        for i in range(20):                                          # each hand-off wakes it
            assert t.submit(lambda i=i: i).result(timeout=5) == i
            time.sleep(0.002 * (i % 3) + (0.15 if i % 5 == 0 else 0))
    finally:
        t.shutdown(wait=True)
    assert not t._thread.is_alive()
