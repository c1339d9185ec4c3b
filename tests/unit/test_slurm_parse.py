"""Reading Slurm 22.05's answers (records and JSON captured from this host's Slurm), the labels a
node's agent gets, why an allocation ended, the sbatch options of a refill, and what evicting a node
does where Slurm refuses a drain (an ordinary user's rights)."""
import json

import pytest

from stalwart.backends import slurm as slurm_mod
from stalwart.backends.base import drain_reason
from stalwart.backends.slurm import (JobInfo, NodeInfo, SlurmBackend, SlurmConfig, SlurmError, ended_reason,
                                     parse_record, switch_labels)

NODE = ("NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=1 CPUTot=1 CPULoad=8.59 "
        "AvailableFeatures=rack1 ActiveFeatures=rack1 Gres=(null) NodeAddr=127.0.0.1 NodeHostName=localhost "
        "Port=49697 Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=100 "
        "AllocMem=0 FreeMem=15576 Sockets=1 Boards=1 State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 "
        "Owner=N/A MCS_label=N/A Partitions=batch,urgent  BootTime=2026-11-25T03:46:09 "
        "SlurmdStartTime=2026-11-25T04:34:21 LastBusyTime=2026-11-25T04:34:21 CfgTRES=cpu=1,mem=100M,billing=1 "
        "AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 "
        "ExtSensorsTemp=n/s Reason=stalwart: incident 3: gpu_xid 79 x=y [root@2026-11-25T04:34:22]\n")
JOB = ("JobId=1 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
       "Account=(null) QOS=(null) JobState=COMPLETING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
       "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:03 TimeLimit=UNLIMITED TimeMin=N/A "
       "EndTime=2026-11-25T04:34:27 Deadline=N/A PreemptEligibleTime=2026-11-25T04:34:24 "
       "PreemptTime=2026-11-25T04:34:27 SuspendTime=None NodeList=n1 BatchHost=n1 NumNodes=1 NumCPUs=2\n")
TOPO = ("SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=n1,n2,n3\nSwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=n[4-6]\n"
        "SwitchName=spine Level=1 LinkSpeed=1 Nodes=n[1-6] Switches=leaf1,leaf2\n")


def test_node_record_keeps_spaces_in_values_and_the_whole_reason():
    rec = parse_record(NODE)
    assert rec["State"] == "IDLE+DRAIN"
    assert rec["Reason"] == "stalwart: incident 3: gpu_xid 79 x=y [root@2026-11-25T04:34:22]"
    assert rec["OS"] == "Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0"
    assert rec["CfgTRES"] == "cpu=1,mem=100M,billing=1" and rec["AllocTRES"] == ""
    assert rec["NodeAddr"] == "127.0.0.1" and rec["ActiveFeatures"] == "rack1"


def test_job_record():
    rec = parse_record(JOB)
    assert rec["JobState"] == "COMPLETING" and rec["Reason"] == "None" and rec["NumNodes"] == "1"


# what `scontrol show hostnames` answers for the lists above (the integration test asks Slurm)
HOSTS = {"n1,n2,n3": ["n1", "n2", "n3"], "n[4-6]": ["n4", "n5", "n6"], "n[1-6]": [f"n{i}" for i in range(1, 7)],
         "": []}


def test_switch_labels_from_a_two_and_a_three_level_tree():
    expand = HOSTS.__getitem__
    assert switch_labels(TOPO, "n5", expand) == {"switch": "leaf2"}        # the root over all leaves is no pod
    three = TOPO + "SwitchName=core Level=2 Nodes=n[1-6] Switches=spine\n"
    assert switch_labels(three, "n2", expand) == {"switch": "leaf1", "pod": "spine"}
    assert switch_labels(TOPO, "n9", expand) == {}


# an entry of `squeue --json --jobs=ID` (Slurm 22.05, openapi v0.0.38), trimmed to what is read
SQUEUE_JOB = {"job_id": 7, "job_state": "COMPLETING", "state_reason": "None", "preempt_time": 1795818530,
              "restart_cnt": 1, "nodes": "n[1-3]", "batch_host": "n1", "comment": "stalwart:/shared/llm",
              "partition": "gpu", "account": "ml", "tres_per_node": "gres:gpu:8", "time_limit": 1440}
SINFO_NODE = {"name": "n1", "address": "10.213.1.10", "active_features": "rack1", "state": "idle",
              "state_flags": ["DRAIN"], "reason": "stalwart: incident 3: gpu_xid"}


def test_jobs_and_nodes_from_slurms_json_and_records_alike():
    j = JobInfo.from_json(SQUEUE_JOB)
    assert (j.state, j.preempted, j.restarts, j.batch_host, j.gres) == ("COMPLETING", True, 1, "n1", "gpu:8")
    assert j.like_this() == ["--partition=gpu", "--account=ml", "--gres=gpu:8", "--time=1440"]
    newer = dict(SQUEUE_JOB, job_state=["RUNNING"], preempt_time={"set": False, "infinite": False, "number": 0},
                 time_limit={"set": True, "infinite": False, "number": 60})
    n = JobInfo.from_json(newer)
    assert (n.state, n.preempted, n.time_limit_min) == ("RUNNING", False, 60)
    r = JobInfo.from_record(parse_record(JOB))
    assert (r.state, r.preempted, r.batch_host, r.restarts) == ("COMPLETING", True, "n1", 0)
    node = NodeInfo.from_json(SINFO_NODE)
    assert (node.address, node.features, node.state) == ("10.213.1.10", "rack1", "IDLE+DRAIN")
    rec = NodeInfo.from_record(parse_record(NODE))
    assert (rec.address, rec.features, rec.state) == ("127.0.0.1", "rack1", "IDLE+DRAIN")


def test_a_refused_drain_excludes_the_node_from_refills_and_tells_the_user(tmp_path, monkeypatch):
    calls = []

    def cli(argv, timeout=30.0):
        calls.append(argv)
        if argv[:2] == ["scontrol", "update"]:          # what Slurm answers an ordinary user
            raise SlurmError("scontrol update nodename=n2: slurm_update error: Access/permission denied")
        return ""
    monkeypatch.setattr(slurm_mod, "run_cli", cli)
    b = SlurmBackend(SlurmConfig(state_dir=str(tmp_path), tag="t1", sbatch_args=["--gres=gpu:8"]))
    b.evict("m1", "stalwart: incident 2: gpu_xid on m1", {"slurm.node": "n2"})
    b.evict("m4", "stalwart: incident 5: machine_lost", {"slurm.node": "n7"})
    assert [c[:2] for c in calls] == [["scontrol", "update"]] * 2
    assert b.sbatch_argv(1, "x.sh")[-2:] == ["--exclude=n2,n7", "x.sh"]
    notes = (tmp_path / "slurm" / "notes.log").read_text().splitlines()
    assert len(notes) == 2 and "Slurm node n2 (m1) is excluded from this job's refills" in notes[0]
    assert "Access/permission denied" in notes[0] and notes[0].endswith("stalwart: incident 2: gpu_xid on m1")
    # drain: never asks Slurm nothing
    calls.clear()
    never = SlurmBackend(SlurmConfig(state_dir=str(tmp_path / "b"), tag="t2", drain="never"))
    never.evict("m0", "stalwart: incident 1: gpu_xid", {"slurm.node": "n1"})
    assert calls == [] and never.state.read()["excluded"] == ["n1"]


def test_the_agents_step_carries_the_users_srun_options(tmp_path):
    b = SlurmBackend(SlurmConfig(state_dir=str(tmp_path), tag="t3",
                                 srun_args=["--container-image=nvcr.io#nvidia/pytorch:25.01-py3", "--mpi=pmix"]))
    argv = b.srun_argv(0, 4)
    assert argv[:5] == ["srun", "--no-kill", "--kill-on-bad-exit=0", "--ntasks-per-node=1", "--nodes=4"]
    assert argv[5:7] == ["--container-image=nvcr.io#nvidia/pytorch:25.01-py3", "--mpi=pmix"]
    assert "stalwart.backends.slurm_agent" in argv and json.loads(open(b.cfg.save()).read())["kind"] == "slurm"


@pytest.mark.parametrize("gres,no_gpus,want", [(None, False, ["--gpus-per-node=8"]),
                                               ("gpu:h100:8", False, ["--gres=gpu:h100:8"]),
                                               (None, True, [])])
def test_gpus_are_asked_for(gres, no_gpus, want):
    from types import SimpleNamespace

    from stalwart.backends.slurm_alloc import gpu_request
    assert gpu_request(SimpleNamespace(gres=gres, no_gpu_request=no_gpus), 8) == want


def test_why_an_allocation_ended():
    assert ended_reason("7", JobInfo("7", "RUNNING")) is None
    assert ended_reason("7", JobInfo("7", "PENDING")) is None
    assert ended_reason("7", JobInfo("7", "TIMEOUT")) == "the Slurm allocation 7 reached its time limit (TIMEOUT)"
    assert ended_reason("7", JobInfo("7", "CANCELLED")) == "the Slurm allocation 7 was cancelled (CANCELLED)"
    # being torn down: the preemption or the time limit is known before the final state
    assert ended_reason("1", JobInfo.from_record(parse_record(JOB))) == \
        "the Slurm allocation 1 was preempted (PREEMPTED)"
    assert ended_reason("7", JobInfo("7", "COMPLETING", reason="TimeLimit")) == \
        "the Slurm allocation 7 reached its time limit (TIMEOUT)"
    assert ended_reason("7", JobInfo("7", "COMPLETING")) == "the Slurm allocation 7 was cancelled (COMPLETING)"
    assert ended_reason("7", None) == "the Slurm allocation 7 is gone (GONE)"


def test_drain_reason_is_one_short_line():
    assert drain_reason(3, "gpu_xid on m0: xid=79") == "stalwart: incident 3: gpu_xid on m0: xid=79"
    long = drain_reason(12, "x" * 500 + "\nmore")
    assert len(long) == 120 and long.endswith("...") and "\n" not in long
