"""The adoption decision of a restarted agent: all of a run's workers when each recorded one is
the same live process, else none, with the reason."""
import os

from stalwart.agent import adopt
from stalwart.agent.adopt import AgentState, WorkerRecord, decide


def rec(pid: int, rank: int, ticks: int = 100) -> WorkerRecord:
    return WorkerRecord(pid=pid, rank=rank, local_rank=rank % 2, start_ticks=ticks,
                        out_path=f"/w/logs/run3_rank{rank}.out", err_path=f"/w/logs/run3_rank{rank}.err")


STATE = AgentState(machine="m1", agent_pid=9, job=1, run=3, workers=(rec(501, 2), rec(502, 3, 110)))


def test_every_worker_alive_and_the_same_is_adopted():
    got = decide(STATE, "m1", {501: 100, 502: 110})
    assert got.adopt == STATE.workers and got.strays == ()
    assert got.reason == "adopting run 3: ranks 2 (pid 501), 3 (pid 502)"


def test_a_recycled_pid_is_never_adopted():
    got = decide(STATE, "m1", {501: 100, 502: 999})
    assert got.adopt == ()
    assert got.strays == (501,)       # the other process is not ours: never stopped
    assert got.reason == "rank 3's pid 502 is another process now (a recycled pid)"


def test_a_rank_gone_adopts_nothing_and_stops_the_rest():
    got = decide(STATE, "m1", {502: 110})
    assert (got.adopt, got.strays) == ((), (502,))
    assert got.reason == "rank 2 (pid 501) of run 3 is gone"


def test_another_machines_record_or_none_or_no_run():
    assert decide(STATE, "m7", {501: 100, 502: 110}).reason == "the recorded workers are machine m1's, not m7's"
    assert decide(STATE, "m7", {501: 100, 502: 110}).strays == (501, 502)
    assert decide(None, "m1", {}) == adopt.Adoption((), (), "no workers recorded in the work directory")
    idle = AgentState(machine="m1", agent_pid=9, job=1, run=None)
    assert decide(idle, "m1", {}).reason == "the previous agent ran no workers"


def test_state_file_round_trip_and_proc_start_time(tmp_path):
    assert adopt.load(str(tmp_path)) is None
    adopt.save(str(tmp_path), STATE)
    assert adopt.load(str(tmp_path)) == STATE
    assert os.stat(tmp_path / adopt.STATE).st_mode & 0o777 == 0o600
    (tmp_path / adopt.STATE).write_text("{not json")
    assert adopt.load(str(tmp_path)) is None        # unreadable: nothing adopted
    me = adopt.start_ticks(os.getpid())
    assert isinstance(me, int) and me > 0
    assert adopt.start_ticks(2**22 + 1) is None
