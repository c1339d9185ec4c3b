"""The worker adapters in one process: the DCP checkpointer's plan reuse, restore, resharding
reader and its fallback when the state does not fit; the DDP gradient hook; a missing extra."""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)

from stalwart.protocol import Env, WorkerChaos
from stalwart.worker import memckpt
from stalwart.worker.shardfmt import header_fields
from stalwart.worker.adapters import dcp as adcp
from stalwart.worker.adapters import require


@pytest.fixture
def ctx(tmp_path, monkeypatch):
    """A real worker context (attached, one rank, no agent) whose in-memory tier is tmp_path/shm."""
    yield from _attached(tmp_path, monkeypatch)


@pytest.fixture
def overlap_ctx(tmp_path, monkeypatch):
    """The same with STALWART_MEM_OVERLAP=1: snapshots are copied beside the next step."""
    monkeypatch.setenv(Env.MEM_OVERLAP, "1")
    yield from _attached(tmp_path, monkeypatch)


def _attached(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", Env.RESTORE_PATH, Env.RUN, Env.AGENT_SOCK, Env.STANDBY):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(Env.SHM_DIR, str(tmp_path / "shm"))
    monkeypatch.setenv(Env.CKPT_DIR, str(tmp_path / "durable"))
    monkeypatch.setenv(Env.CKPT_EVERY, "2")
    monkeypatch.setenv(Env.SDK_STEPS, "0")          # (restored by monkeypatch after the test)
    from stalwart import worker
    c = worker.attach()
    assert os.environ[Env.SDK_STEPS] == "1"         # the start-up hook's counting stands down
    yield c
    c.finish()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train_step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("overlap", [False, True])
def test_dcp_plans_once_and_restores_exactly(overlap, request, monkeypatch):
    ctx = request.getfixturevalue("overlap_ctx" if overlap else "ctx")
    assert ctx.mem.overlap is overlap
    fences = []
    fence = ctx.mem.fence
    monkeypatch.setattr(ctx.mem, "fence", lambda: (fences.append(1), fence())[1])
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = adcp.Checkpointer(ctx)
    try:
        for step in range(5):
            _train_step(model, opt, step)
            ck.save({"model": model.state_dict(), "optim": opt.state_dict()}, step)
    finally:
        ck.close()
    ctx.mem.wait()
    # overlapped: every optimizer step waited for the copy before it, and none was torn
    assert len(fences) == (5 if overlap else 0) and ctx.mem.overlap_off is None
    assert ck.replans == 1 and ck.saves == 5       # one DCP plan; four saves reused it
    assert ctx._last_reported == 4                  # each save reported its step
    # the newest slot, as the agent would materialize it for a restart of this rank
    step, path = memckpt.latest(ctx.mem.dir, 0)
    assert step == 4
    monkeypatch.setenv(Env.RESTORE_PATH, path)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _train_step(fresh, fresh_opt, 99)               # (creates the optimizer's state to load into)
    state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    assert adcp.Checkpointer(ctx).load(state) == 5
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    _train_step(model, opt, 5)
    _train_step(fresh, fresh_opt, 5)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_dcp_replans_when_a_shape_changes(ctx):
    ck = adcp.Checkpointer(ctx)
    ck.save({"w": torch.ones(3)}, 0)
    ck.save({"w": torch.ones(3) * 2}, 1)
    ck.save({"w": torch.ones(5)}, 2)                # a new shape: a new plan
    ck.save({"w": torch.ones(5), "b": torch.zeros(2)}, 3)
    ctx.mem.wait()
    assert ck.replans == 3
    sd = {"w": torch.zeros(5), "b": torch.ones(2)}
    assert adcp.load_from(ctx.mem.dir, sd) == 3
    assert torch.equal(sd["w"], torch.ones(5)) and torch.equal(sd["b"], torch.zeros(2))


def test_replicas_write_identical_shards_so_backups_are_twins(ctx, tmp_path):
    """Two data-parallel replicas (same state, other ranks) write shards with the same checksum
    and size: a backup peer running one replica keeps a reference to its own copy of the other's
    (agent/twins.py) instead of receiving it."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = adcp.Checkpointer(ctx)
    _train_step(model, opt, 0)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    ck.save(state, 0)
    ctx.mem.wait()
    fields = []
    for rank, d in ((0, str(tmp_path / "m0")), (1, str(tmp_path / "m1"))):
        ck.rank = rank                      # (this process is the replica of either rank)
        with memckpt.MemCheckpointer(d, rank) as m:
            m.snapshot(ck._payload(state, 0), 0)
        path = memckpt.list_shards(d, rank)[0][2]
        fields.append(header_fields(open(path, "rb").read(), meta=False))
    assert fields[0]["rank"] == 0 and fields[1]["rank"] == 1
    assert all(fields[0][k] == fields[1][k] for k in ("nbytes", "hash", "checksum"))


def _shard_payload(rank: int, rows: torch.Tensor, md: Metadata, world: int, step: int) -> dict:
    import pickle
    return {"format": adcp.FORMAT, "step": step, "world": world, "md": pickle.dumps(md),
            "index": pickle.dumps([("w", (2 * rank, 0), False), ("n", None, True)]),
            "tensors": [rows], "objects": [7]}


def test_reader_reshards_from_other_ranks_shards(tmp_path):
    """A 4x4 tensor saved as two row shards by two ranks loads whole into one process: the
    reader finds the second rank's chunk in the directory (DCP's resharding)."""
    full = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    props = TensorProperties(dtype=torch.float32)
    md = Metadata(state_dict_metadata={
        "w": TensorStorageMetadata(properties=props, size=torch.Size([4, 4]), chunks=[
            ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 4])),
            ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 4]))]),
        "n": BytesStorageMetadata()})
    d = str(tmp_path / "durable")
    for rank in (0, 1):
        with memckpt.MemCheckpointer(d, rank) as m:
            m.snapshot(_shard_payload(rank, full[2 * rank:2 * rank + 2].clone(), md, 2, 6), 6)
    sd = {"w": torch.zeros(4, 4), "n": 0}
    assert adcp.load_from(d, sd) == 6
    assert torch.equal(sd["w"], full) and sd["n"] == 7
    # without the second rank's shard the missing chunk is named
    os.remove(memckpt.list_shards(d, 1)[0][2])
    with pytest.raises(CheckpointException) as e:          # (DCP wraps each rank's error)
        adcp.load_from(d, {"w": torch.zeros(4, 4), "n": 0})
    assert "no shard of step 6 holds 'w' at offset (2, 0)" in str(e.value)


def test_state_too_large_for_memory_falls_back_to_dcp_files(ctx, monkeypatch, capsys):
    monkeypatch.setattr(adcp, "_free_bytes", lambda path: 1000)       # a nearly full /dev/shm
    ck = adcp.Checkpointer(ctx)
    for step in range(4):
        ck.save({"w": torch.full((512,), float(step))}, step)
    err = capsys.readouterr().err.strip().splitlines()
    assert len([e for e in err if e.startswith("error:")]) == 1, err
    assert "needs" in err[0] and "MiB of shared memory" in err[0] and "every 2 steps" in err[0]
    assert memckpt.list_shards(ctx.mem.dir, 0) == []                   # nothing half-written there
    sd = {"w": torch.zeros(512)}
    assert adcp.Checkpointer(ctx).load(sd) == 4                        # steps 1 and 3 saved: 3 + 1
    assert torch.equal(sd["w"], torch.full((512,), 3.0))


@pytest.fixture
def world1():
    """A one-rank gloo process group in this process (no other process)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


class _Ctx:
    def __init__(self) -> None:
        self.reports: list[dict] = []
        self.nan_from: int | None = None
        self._local_grad_norm = None

    def chaos_active(self, kind: str, step: int) -> bool:
        return kind == "nan" and self.nan_from is not None and step >= self.nan_from

    def report(self, step: int, **kw) -> None:
        self.reports.append(dict(kw, step=step))


def test_ddp_hook_gives_per_rank_and_reduced_grad_norms(world1):
    from stalwart.worker.adapters import ddp
    model = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.0001)   # several buckets
    c = _Ctx()
    w = ddp.watch(model, c)
    for step in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        expect = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
        w.report(step, loss=1.0)
        model.zero_grad()
        assert w.local_grad_norm == pytest.approx(expect, rel=1e-5)
        assert w.grad_norm == pytest.approx(expect, rel=1e-5)           # one rank: the mean is itself
        assert c._local_grad_norm == w.local_grad_norm
    assert [r["step"] for r in c.reports] == [0, 1, 2] and c.reports[-1]["grad_norm"] == w.grad_norm
    c.nan_from = 3                                                      # the nan chaos from step 3 on
    model(torch.randn(4, 8)).pow(2).mean().backward()
    assert w.local_grad_norm != w.local_grad_norm                       # NaN
    assert all(torch.isnan(p.grad).all() for p in model.parameters())


def test_missing_extra_is_one_line():
    with pytest.raises(SystemExit) as e:
        require("stalwart_no_such_framework.pytorch", "lightning", "Lightning")
    msg = str(e.value)
    assert msg == ("error: stalwart's Lightning adapter needs stalwart_no_such_framework, which is not "
                   "installed: pip install 'stalwart[lightning]'")


def test_warm_standby_waits_at_the_adapter_for_its_ranks(tmp_path, monkeypatch):
    """A spare (STALWART_STANDBY=1) says it is ready on the agent's socket and blocks until the
    agent activates it with the run's environment; a context made afterwards goes on with the same
    link (one connection per worker), chaos sent before it included."""
    import socket
    import threading

    from stalwart.transport.jsonlines import JsonLineSocket
    from stalwart.worker import standby
    path = str(tmp_path / "agent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(2)
    srv.settimeout(30)
    got: list[dict] = []
    conns: list[JsonLineSocket] = []

    def agent() -> None:
        c, _ = srv.accept()
        conn = JsonLineSocket(c)
        conns.append(conn)
        got.append(conn.recv())                          # standby_ready
        conn.send({"type": "chaos", "kind": "nan", "from_step": 3})
        conn.send({"type": "activate", "env": {"RANK": "5", "STALWART_RUN": "7"}})
        got.append(conn.recv())                          # the context's hello, on the same link

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    for k in ("RANK", Env.RUN, Env.RESTORE_PATH, Env.SHM_DIR):
        # set, then removed: monkeypatch then restores each as it was, also what the activation sets
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setenv(Env.STANDBY, "1")
    monkeypatch.setenv(Env.AGENT_SOCK, path)
    monkeypatch.setattr(standby, "_link", None)
    try:
        standby.wait_if_standby()
        assert os.environ["RANK"] == "5" and Env.STANDBY not in os.environ
        assert got[0]["type"] == "standby_ready" and got[0]["pid"] == os.getpid()
        later: list[WorkerChaos] = []
        link = standby.take_link(later.append)
        assert link is standby._link and later == [WorkerChaos(kind="nan", from_step=3)]
        link.send({"type": "hello", "rank": 5})
        t.join(30)
        assert got[1] == {"type": "hello", "rank": 5}
    finally:
        if standby._link is not None:
            standby._link.close()
        monkeypatch.setattr(standby, "_handler", None)
        for conn in conns:
            conn.close()
        srv.close()


def _hf_trainer(out: str, losses: dict, stop_after: int | None = None):
    """A tiny GPT-2 (dropout on, as configured by default) under a one-process Trainer of 4 steps
    at a constant learning rate; `losses` collects each step's loss as the Trainer logs it, and
    the training stops after step `stop_after` if given (the schedule is the 4 steps' still)."""
    tf = pytest.importorskip("transformers")

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            ids = (i + torch.arange(16)) % 64
            return {"input_ids": ids, "labels": ids.clone()}

    class Losses(tf.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if stop_after is not None and state.global_step - 1 >= stop_after:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step - 1] = logs["loss"]

    cfg = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    assert cfg.resid_pdrop > 0                   # the redone steps draw dropout masks again
    torch.manual_seed(0)
    args = tf.TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=4,
                                learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
                                save_strategy="no", report_to=[], use_cpu=True, seed=0,
                                dataloader_num_workers=0, disable_tqdm=True)
    return tf.Trainer(model=tf.GPT2LMHeadModel(cfg), args=args, train_dataset=Tokens(), callbacks=[Losses()])


def test_hf_trainer_resumed_from_memory_trains_the_next_steps_bit_for_bit(ctx, monkeypatch, tmp_path):
    """The callback's per-step copy in the in-memory tier, given back through `resume_dir` as a
    Trainer checkpoint, puts back the model, the optimizer, the data position and the random
    generators: the steps after the restored one give the losses they gave the first time."""
    pytest.importorskip("transformers")
    from stalwart.worker.adapters import hf
    whole: dict = {}
    _hf_trainer(str(tmp_path / "whole"), whole).train()     # the reference: 4 steps, no fault
    first: dict = {}
    trainer = _hf_trainer(str(tmp_path / "a"), first, stop_after=1)
    hf.install(trainer).ctx = ctx                # (attached already: the fixture's context)
    trainer.train()                              # steps 0 and 1, then the "fault"
    assert first == {0: whole[0], 1: whole[1]}
    step, path = memckpt.latest(ctx.mem.dir, 0)
    assert step == 1
    monkeypatch.setenv(Env.RESTORE_PATH, path)   # as the agent sets it for the restarted rank
    again: dict = {}
    redo = _hf_trainer(str(tmp_path / "b"), again)
    cb = hf.install(redo, checkpoint=False)
    resume = cb.resume_dir()
    assert resume is not None and os.path.exists(os.path.join(resume, "rng_state.pth"))
    redo.train(resume_from_checkpoint=resume)
    assert again == {2: whole[2], 3: whole[3]}


def _lightning_run(root: str, losses: dict, stop_after: int | None = None, callbacks: tuple = ()):
    """A tiny model with dropout under a one-process Lightning Trainer of 4 steps (SGD, no
    scheduler), each step's batch drawn from the step (Lightning restarts a plain loader's epoch on
    a resume: docs/integration.md); `losses` collects each step's loss; training stops after step
    `stop_after`."""
    L = pytest.importorskip("lightning.pytorch")

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1))

        def training_step(self, _indices, i):
            g = torch.Generator().manual_seed(self.global_step)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
            loss = (self.net(x) - y).pow(2).mean()
            losses[self.global_step] = float(loss)
            if stop_after is not None and self.global_step >= stop_after:
                self.trainer.should_stop = True
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        callbacks=list(callbacks))
    return trainer, Net(), torch.utils.data.DataLoader(list(range(16)), batch_size=1)


def test_lightning_resumed_from_memory_trains_the_next_steps_bit_for_bit(ctx, monkeypatch, tmp_path):
    """The callback's per-step copy of Lightning's checkpoint, its own state (the random generators)
    included, resumes a model with dropout: the steps after the restored one give the losses they
    gave the first time."""
    pytest.importorskip("lightning.pytorch")
    from stalwart.worker.adapters.lightning import StalwartCallback
    whole: dict = {}
    trainer, model, data = _lightning_run(str(tmp_path / "whole"), whole)
    trainer.fit(model, data)                                 # the reference: 4 steps, no fault
    first: dict = {}
    cb = StalwartCallback()
    cb.ctx = ctx                                             # (attached already: the fixture's context)
    trainer, model, data = _lightning_run(str(tmp_path / "a"), first, stop_after=1, callbacks=(cb,))
    trainer.fit(model, data)                                 # steps 0 and 1, then the "fault"
    assert first == {0: whole[0], 1: whole[1]}
    step, path = memckpt.latest(ctx.mem.dir, 0)
    assert step == 1
    monkeypatch.setenv(Env.RESTORE_PATH, path)               # as the agent sets it for the restarted rank
    monkeypatch.setenv(Env.CKPT_DIR, str(tmp_path / "resume"))
    again: dict = {}
    cb2 = StalwartCallback(checkpoint=False)
    trainer, model, data = _lightning_run(str(tmp_path / "b"), again, callbacks=(cb2,))
    trainer.fit(model, data, ckpt_path=cb2.resume_path())
    assert again == {2: whole[2], 3: whole[3]}


def test_ddp_hook_takes_the_norms_once_every_bucket_was_reduced_in_any_order():
    # the backend completes the buckets' reductions on its own threads: the last bucket's may come first
    from stalwart.worker.adapters import ddp

    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t
    grads = [torch.full((4,), float(i + 1)) for i in range(3)]
    w = ddp.GradWatch(None)
    for g in grads:
        w._before(Bucket(g))
    w._last_bucket()
    for g in reversed(grads):
        assert w.grad_norm is None
        w._after(g)
    expect = float(torch.linalg.vector_norm(torch.cat(grads)))
    assert w.grad_norm == pytest.approx(expect) and w.local_grad_norm == pytest.approx(expect)
