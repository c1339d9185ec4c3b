"""The controller's side of the backend interface, with a recording backend: an eviction a job's
executor carries out is passed on with the incident as the reason and the labels the agent
registered with; refills are asked less those already coming; the cluster's end is asked of the
backend once."""
from __future__ import annotations

from stalwart import protocol
from stalwart.backends.base import Backend
from stalwart.controller.job import actions as a
from stalwart.controller.job.executor import Executor
from stalwart.controller.cluster.roles import Role
from stalwart.controller.service import Controller
from stalwart.spec import JobSpec


class Recording(Backend):
    kind = "recording"

    def __init__(self):
        self.evicted: list[tuple] = []
        self.asked: list[int] = []
        self.next = 5
        self.end: str | None = None

    def start_agents(self, controller_url, count):
        raise AssertionError("the controller never starts agents")

    def evict(self, machine, reason, labels):
        self.evicted.append((machine, reason, labels))

    def request(self, count):
        self.asked.append(count)
        names = [f"m{self.next + i}" for i in range(count)]
        self.next += count
        return names

    def ended(self):
        return self.end

    def release(self):
        pass


def controller(tmp_path, backend):
    return Controller(f"sqlite:///{tmp_path}/s.db", str(tmp_path), backend=backend)


def test_eviction_reason_and_labels_reach_the_backend(tmp_path):
    b = Recording()
    ctl = controller(tmp_path, b)
    try:
        ctl.register("m1", protocol.Registration(address="10.0.0.2", gpus=8, labels={"slurm.node": "n7",
                                                                                         "switch": "leaf2"}))
        job = ctl.store.create_job("t", {}, 0.0)
        ex = Executor(ctl.job_ports(job), job, JobSpec(machines=1, gpus_per_machine=8, command=["x"]))
        ex.perform(None, [a.AssignMachine(machine="m1", state=Role.EVICTED, reason="gpu_xid on m1: xid=79",
                                          incident=3)], None)
        assert b.evicted == [("m1", "stalwart: incident 3: gpu_xid on m1: xid=79",
                              {"slurm.node": "n7", "switch": "leaf2"})]
        got = ctl.registry.get("m1")
        assert got is not None and got.role is Role.EVICTED and got.job_id == job
        assert {m["id"]: m["state"] for m in ctl.store.machines()} == {"m1": "evicted"}
        ex.perform(None, [a.AssignMachine(machine="m1", state=Role.STANDBY)], None)   # not an eviction
        assert len(b.evicted) == 1
    finally:
        ctl.close()


def test_refills_asked_less_those_coming(tmp_path):
    b = Recording()
    ctl = controller(tmp_path, b)
    try:
        job = ctl.store.create_job("t", {}, 0.0)
        assert ctl.supply.request(job, 2) == ["m5", "m6"]
        assert ctl.supply.request(job, 2) == []                  # both still coming
        ctl.register("m5", protocol.Registration(address="10.0.0.5", gpus=8))
        assert ctl.supply.request(job, 2) == ["m7"]              # m6 still coming
        assert b.asked == [2, 1]
        assert [e["data"]["machines"] for e in ctl.store.events(job) if e["kind"] == "machines_requested"] == \
            [["m5", "m6"], ["m7"]]
    finally:
        ctl.close()


def test_the_cluster_end_is_asked_of_the_backend(tmp_path):
    b = Recording()
    ctl = controller(tmp_path, b)
    try:
        assert not ctl._cluster_ended()
        b.end = "the Slurm allocation 12 was preempted (PREEMPTED)"
        assert ctl._cluster_ended() and ctl._ended == b.end
        b.end = None
        assert ctl._cluster_ended()                              # once ended, ended
    finally:
        ctl.close()
