"""Parsing Slurm 22.05's CLI output (lines captured from this host's Slurm), the labels a node's
agent gets, and why an allocation ended."""
from stalwart.backends.base import drain_reason
from stalwart.backends.slurm import ended_reason, expand_hostlist, parse_record, switch_labels

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


def test_hostlists():
    assert expand_hostlist("n[1-3,5],gpu[08-10],login") == ["n1", "n2", "n3", "n5", "gpu08", "gpu09", "gpu10",
                                                            "login"]
    assert expand_hostlist("n4") == ["n4"] and expand_hostlist("") == []


def test_switch_labels_from_a_two_and_a_three_level_tree():
    assert switch_labels(TOPO, "n5") == {"switch": "leaf2"}        # the root over all leaves is no pod
    three = TOPO.replace("Level=1", "Level=1") + "SwitchName=core Level=2 Nodes=n[1-6] Switches=spine\n"
    assert switch_labels(three, "n2") == {"switch": "leaf1", "pod": "spine"}
    assert switch_labels(TOPO, "n9") == {}


def test_why_an_allocation_ended():
    assert ended_reason("7", {"JobState": "RUNNING"}) is None
    assert ended_reason("7", {"JobState": "PENDING"}) is None
    assert ended_reason("7", {"JobState": "TIMEOUT"}) == "the Slurm allocation 7 reached its time limit (TIMEOUT)"
    assert ended_reason("7", {"JobState": "CANCELLED"}) == "the Slurm allocation 7 was cancelled (CANCELLED)"
    # being torn down: the preemption or the time limit is known before the final state
    assert ended_reason("1", parse_record(JOB)) == "the Slurm allocation 1 was preempted (PREEMPTED)"
    assert ended_reason("7", {"JobState": "COMPLETING", "Reason": "TimeLimit", "PreemptTime": "None"}) == \
        "the Slurm allocation 7 reached its time limit (TIMEOUT)"
    assert ended_reason("7", {"JobState": "COMPLETING", "Reason": "None", "PreemptTime": "None"}) == \
        "the Slurm allocation 7 was cancelled (COMPLETING)"
    assert ended_reason("7", None) == "the Slurm allocation 7 is gone (GONE)"


def test_drain_reason_is_one_short_line():
    assert drain_reason(3, "gpu_xid on m0: xid=79") == "stalwart: incident 3: gpu_xid on m0: xid=79"
    long = drain_reason(12, "x" * 500 + "\nmore")
    assert len(long) == 120 and long.endswith("...") and "\n" not in long
