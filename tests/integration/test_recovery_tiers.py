"""Warm standbys and every-step in-memory checkpoints with over-eviction-aware backups."""
import pytest
import torch

from jobrun import gpt_spec, losses, run_job, wait_for
from stalwart.agent.ckpt import CkptManager
from stalwart.worker.memckpt import MemCheckpointer


def tiers(rep, run=-1):
    return {int(r): t for r, t in rep["runs"][run]["restore"]["tiers"].items()}


@pytest.mark.timeout(400)
def test_standby_takes_over_lost_machine_bitwise(tmp_path):
    # backups every step (not paced): the lost machine's ranks restore at most one step back
    spec = dict(machines=2, gpus=2, tp=2, dp=2, steps=40, standby=1, backup_every=1)
    base = run_job(tmp_path / "clean", gpt_spec(**spec))
    rep = run_job(tmp_path / "down", gpt_spec(**spec, chaos=["machine-down@step=20,machine=1"]))
    assert base["state"] == rep["state"] == "succeeded", rep.get("reason")
    [inc] = rep["incidents"]
    assert inc["machines_evicted"] == ["m1"] and inc["mechanism"] == "evict_restart"
    assert rep["runs"][-1]["machines"] == {"0": "m0", "1": "m2"}
    assert rep["steps_lost"] <= 1
    assert rep["runs"][1]["start_step"] >= 19
    assert tiers(rep) == {0: "own", 1: "own", 2: "backup", 3: "backup"}
    assert losses(rep) == losses(base)


@pytest.mark.timeout(400)
def test_over_evicting_a_pipeline_group_restores_from_backup_peers(tmp_path):
    # pp=2, dp=2 on 4 machines x 1: the PP group of rank 0 is machines m0 and m2; both die at once.
    rep = run_job(tmp_path, gpt_spec(machines=4, gpus=1, pp=2, dp=2, steps=40, standby=2, backup_every=1,
                                     chaos=["machine-down@step=15,machine=0",
                                            "machine-down@step=15,machine=2"]))
    assert rep["state"] == "succeeded", rep.get("reason")
    evicted = sorted(m for i in rep["incidents"] for m in i["machines_evicted"])
    assert evicted == ["m0", "m2"]
    t = tiers(rep)
    assert "durable" not in t.values(), t
    assert t[0] == t[2] == "backup" and t[1] == t[3] == "own"
    assert rep["steps_lost"] <= 1


@pytest.mark.timeout(400)
def test_machine_and_its_backup_peer_down_fall_back_to_durable(tmp_path):
    # dp=3 on 3 machines: m1 backs up to m2. Both die: rank 1 has no copy in memory anywhere.
    spec = gpt_spec(machines=3, gpus=1, dp=3, steps=40, standby=2, ckpt_every=5,
                    chaos=["machine-down@step=20,machine=1", "machine-down@step=20,machine=2"])
    spec["command"] += ["--batch", "12"]     # divisible by dp*micro-batches = 3*2
    # steps of at least 0.1 s: the controller fires the chaos when it has committed step 20, and
    # the workers must not have finished the job by then however fast they train
    spec["command"] += ["--min-compute-s", "0.1"]
    rep = run_job(tmp_path, spec)
    assert rep["state"] == "succeeded", rep.get("reason")
    t = tiers(rep)
    assert t[1] == "durable", t
    restore_step = rep["runs"][-1]["restore"]["step"]
    assert (restore_step + 1) % 5 == 0 and restore_step >= 9
    assert rep["steps_completed"] == 40


def _model_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g), "step_note": seed}


def _flip(path):
    data = path[:-4] + ".data"
    with open(data, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.timeout(120)
def test_corrupt_shard_is_skipped_tier_by_tier(tmp_path):
    events = []
    a = CkptManager("mA", str(tmp_path / "a"), events.append)
    b = CkptManager("mB", str(tmp_path / "b"), events.append)
    durable = str(tmp_path / "durable")
    key = bytes(range(32))                            # the job's checkpoint key, as the controller gives it
    try:
        b.configure(None, every=3, backup=None, key=key)
        a.configure(durable, every=3, backup={"machine": "mB", "addr": list(b.peer_addr)}, key=key)
        mem = MemCheckpointer(a.shm_dir, 0)
        for step in range(3):
            mem.snapshot(_model_state(step), step)
        mem.close()
        def have(tier):
            return any(e.tier == tier and e.step == 2 for e in events)
        assert wait_for(lambda: have("backup") and have("durable")), events
        cands = [{"tier": "own", "step": 2}, {"tier": "backup", "step": 2, "holder": "mB",
                                                "addr": list(b.peer_addr)}, {"tier": "durable", "step": 2}]
        tier, path, errors = a.materialize(0, cands)
        assert tier == "own" and errors == []
        _flip(path)                                   # own copy corrupted: the peer's copy serves
        tier, path, errors = a.materialize(0, cands)
        assert tier == "backup" and "checksum" in errors[0]
        own_backup = b.store.fetch(0, 2, "backup")
        _flip(own_backup)                             # the peer's too: the durable copy serves
        tier, path, errors = a.materialize(0, cands)
        assert tier == "durable" and len(errors) == 2
        from stalwart.worker.memckpt import load
        step, state = load(path, 0)
        assert step == 2 and torch.equal(state["w"], _model_state(2)["w"])
    finally:
        a.close()
        b.close()
