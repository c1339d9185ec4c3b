"""A plain script's steps without the SDK: the step hook's records (worker/stephook.py), the agent's
reading of them (agent/scriptsteps.py) and the controller's numbering across restarts from the
script's own snapshots (controller/rules/scriptsteps.py)."""
import json
import os

import msgspec

from stalwart import protocol as p
from stalwart.agent import scriptsteps as agent_side
from stalwart.controller.rules.scriptsteps import ScriptRun, number
from stalwart.worker import stephook


def steps(out):
    return [(s.rank, s.step) for s in out]


def test_a_fresh_script_counts_from_zero_and_its_saves_are_marks():
    marks: dict[str, int] = {}
    run = ScriptRun()
    out = number(run, marks, 0, [["step", 1, 10.0], ["step", 2, 10.5], ["save", 2, 10.6, "/w/snap.pt"]])
    assert steps(out) == [(0, 0), (0, 1)] and run.base == 0
    assert [s.dur for s in out] == [0.0, 0.5]          # from the end of the rank's step before
    assert marks == {"/w/snap.pt": 2}
    out = number(run, marks, 1, [["step", 1, 10.1], ["step", 2, 10.6]])
    assert steps(out) == [(1, 0), (1, 1)]


def test_a_restarted_script_goes_on_from_the_snapshot_it_loaded_and_other_ranks_wait_for_it():
    marks = {"/w/snap.pt": 64}
    run = ScriptRun()
    # any rank's load of a marked file sets the run's first step
    assert steps(number(run, marks, 1, [["load", 0, 5.0, "/w/snap.pt"], ["step", 1, 6.0]])) == [(1, 64)]
    # rank 1's steps come first (its machine's agent was quicker): they wait for rank 0's load
    run = ScriptRun()
    assert number(run, marks, 1, [["step", 1, 6.0], ["step", 2, 6.2]]) == [] and run.base is None
    out = number(run, marks, 0, [["load", 0, 5.0, "/data/weights.pt"], ["load", 0, 5.1, "/w/snap.pt"],
                                 ["step", 1, 6.0]])
    assert run.base == 64
    assert sorted(steps(out)) == [(0, 64), (1, 64), (1, 65)]
    out = number(run, marks, 0, [["step", 2, 6.2], ["save", 2, 6.3, "/w/snap.pt"]])
    assert steps(out) == [(0, 65)] and marks["/w/snap.pt"] == 66


def test_an_unknown_file_loaded_is_no_snapshot_and_a_renamed_save_keeps_its_mark():
    marks: dict[str, int] = {}
    run = ScriptRun()
    out = number(run, marks, 0, [["load", 0, 1.0, "/data/pretrained.pt"], ["step", 1, 2.0], ["step", 2, 3.0],
                                 ["save", 2, 3.1, "/w/snap.pt.tmp"], ["move", 2, 3.2, "/w/snap.pt.tmp", "/w/snap.pt"]])
    assert run.base == 0 and steps(out) == [(0, 0), (0, 1)]
    assert marks == {"/w/snap.pt": 2}


def test_the_hook_counts_the_lead_optimizers_steps_and_writes_them_in_order(tmp_path):
    class Opt:
        pass
    st = stephook.Steps()
    d, g = Opt(), Opt()
    for _ in range(3):          # two optimizers a step (a GAN): one step each time
        st.on_step(d)
        st.on_step(g)
    st.on_file("save", str(tmp_path / "snap.pt"))
    st.on_file("save", object())                 # a file object (BytesIO): not a mark
    st.on_move(str(tmp_path / "other.tmp"), str(tmp_path / "x"))        # not saved here: ignored
    del d                                        # the lead is gone: the next optimizer leads
    st.on_step(g)
    path = st.flush(str(tmp_path))
    with open(path) as f:
        records = json.load(f)
    assert [r[:2] for r in records] == [["s", 1], ["s", 2], ["s", 3], ["save", 3], ["s", 4]]
    assert records[3][3] == str(tmp_path / "snap.pt")
    assert st.flush(str(tmp_path)) is None       # nothing new


def test_the_agent_reads_each_workers_files_in_order_and_drops_the_others(tmp_path):
    st = stephook.Steps()
    for _ in range(2):
        st.on_step(st)
        st.flush(str(tmp_path))
    mine = [n for n in os.listdir(tmp_path)]
    pid = os.getpid()
    (tmp_path / "99999999-000000001.steps").write_text('[["s", 1, 1.0]]')      # a process of no worker
    (tmp_path / f"{pid}.json").write_text("{}")                                 # a flight-recorder summary
    [msg] = agent_side.collect(str(tmp_path), {3: {pid}}, run=2)
    assert isinstance(msg, p.Script)
    assert p.decode_event(msgspec.to_builtins(msg)) == msg          # what the controller reads
    assert msg.rank == 3 and msg.run == 2
    assert [(r.kind, r.n) for r in msg.records] == [("step", 1), ("step", 2)]
    assert sorted(os.listdir(tmp_path)) == [f"{pid}.json"] and len(mine) == 2
    # an SDK worker's files are dropped unread
    st.on_step(st)
    st.flush(str(tmp_path))
    assert agent_side.collect(str(tmp_path), {0: {pid}}, run=2, skip={pid}) == []
    assert sorted(os.listdir(tmp_path)) == [f"{pid}.json"]


def test_a_snapshot_carries_its_steps_so_a_restart_numbers_right_without_the_saves_records(tmp_path):
    """The save's records died with a lost machine: the job's marks are stale, the file is not."""
    snap = str(tmp_path / "snap.pt")
    first = stephook.Steps()
    for _ in range(5):
        first.on_step(first)
    open(snap, "w").close()
    first.on_file("save", snap)
    if stephook.read_mark(snap) is None:
        import pytest
        pytest.skip("this file system keeps no user extended attributes")
    assert stephook.read_mark(snap) == 5
    again = stephook.Steps()          # the restarted process
    again.on_file("load", snap)
    again.on_step(again)
    again.on_file("save", snap)
    assert again.base == 5 and stephook.read_mark(snap) == 6
    records = [["step" if r[0] == "s" else r[0], *r[1:]] for r in again.take()]     # as the agent passes them
    assert records[0][0] == "load" and records[0][4] == 5
    run, stale = ScriptRun(), {snap: 3}
    assert steps(number(run, stale, 0, records)) == [(0, 5)] and stale[snap] == 6


def test_a_checkpoint_written_through_a_buffer_is_numbered_by_its_own_global_step(tmp_path):
    """Lightning's way: `torch.save` into a BytesIO whose bytes go to the file, and `torch.load`
    of an open file object. The file carries no mark; the checkpoint's `global_step` numbers the
    restarted run, and a loaded dict without one is no snapshot."""
    import io

    import torch
    ckpt = str(tmp_path / "last.ckpt")
    first = stephook.Steps()
    for _ in range(7):
        first.on_step(first)
    buf = io.BytesIO()
    torch.save({"global_step": 7, "state_dict": {"w": torch.ones(2)}}, buf)
    first.on_file("save", buf)                   # an in-memory buffer: nothing to mark
    with open(ckpt, "wb") as f:
        f.write(buf.getvalue())
    assert [r[0] for r in first.take()] == ["s"] * 7      # (no save record: no path to mark)
    again = stephook.Steps()                     # the restarted process
    with open(ckpt, "rb") as f:
        obj = torch.load(f)
        again.on_file("load", f, obj)            # a file object open on the file: its path
    plain = io.BytesIO()
    torch.save({"w": torch.zeros(1)}, plain)
    plain.seek(0)
    again.on_file("load", plain, torch.load(plain))   # no path, no step: nothing recorded
    again.on_step(again)
    assert again.base == 7
    records = [["step" if r[0] == "s" else r[0], *r[1:]] for r in again.take()]
    assert [r[0] for r in records] == ["load", "step"] and records[0][3] == ckpt and records[0][4] == 7
    assert steps(number(ScriptRun(), {}, 0, records)) == [(0, 7)]
