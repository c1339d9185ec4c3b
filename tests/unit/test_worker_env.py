"""The environment an agent gives the processes it starts (agent/workerenv.py)."""
import torch

from stalwart import protocol as p
from stalwart.agent.workerenv import WorkerEnv
from stalwart.worker.standby import _take_threads


def _env(gpus: int) -> WorkerEnv:
    return WorkerEnv("m0", "/run/agent.sock", "/run/simgpu.json", "/dev/shm/x", "/run/fr", None,
                     lambda: 1.0, lambda: 5.0, gpus=gpus)


def test_several_ranks_a_machine_get_one_intra_op_thread_each_unless_the_machine_says_otherwise(monkeypatch):
    """As torchrun: with more than one process a machine, OMP_NUM_THREADS=1 where it is not set."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = _env(2).base()
    assert env["OMP_NUM_THREADS"] == "1" and env[p.Env.MACHINE] == "m0"
    assert "OMP_NUM_THREADS" not in _env(1).base()
    monkeypatch.setenv("OMP_NUM_THREADS", "6")                  # the machine's own choice stands
    assert _env(8).base()["OMP_NUM_THREADS"] == "6"


def test_a_warm_worker_takes_the_runs_thread_count():
    before = torch.get_num_threads()
    try:
        _take_threads("1")
        assert torch.get_num_threads() == 1
        _take_threads("not a number")
        _take_threads(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
