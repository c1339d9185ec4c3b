"""The executor's transactions: routine progress records wait for the next one, in order."""
from types import SimpleNamespace

from stalwart.controller.job import actions as a
from stalwart.controller.job.executor import MAX_DEFERRED, Executor
from stalwart.spec import JobSpec


class _Store:
    def __init__(self):
        self.commits: list[tuple[list, bytes | None]] = []

    def commit(self, job_id, ops, state):
        self.commits.append(([(type(op).__name__, op.kind, op.data.get("step")) for op in ops], state))


def _executor():
    store = _Store()
    ports = SimpleNamespace(store=store)            # (the only port these actions use)
    ex = Executor(ports, 1, JobSpec(machines=2, gpus_per_machine=1, command=["x"]))
    return ex, store


def step(s: int) -> a.Record:
    return a.Record(kind="step", data={"run": 1, "step": s}, t=float(s))


def test_step_records_wait_for_the_state_save_and_keep_their_order():
    ex, store = _executor()
    ex.perform(None, [step(0)], None)
    ex.perform(None, [step(1), a.Record(kind="rank_times", data={"step": 1}, t=1.0)], None)
    assert store.commits == []                                   # nothing written per step
    ex.perform(None, [step(2)], b"{}")                           # the state's save takes them along
    assert store.commits == [([("Record", "step", 0), ("Record", "step", 1), ("Record", "rank_times", 1),
                               ("Record", "step", 2)], b"{}")]
    # anything else is written at once, the waiting records first; a routine record behind it
    # stays behind it
    ex.perform(None, [step(3)], None)
    ex.perform(None, [step(4), a.Record(kind="incident_opened", data={}, t=4.0), step(5)], None)
    assert store.commits[-1] == ([("Record", "step", 3), ("Record", "step", 4), ("Record", "incident_opened", None),
                                  ("Record", "step", 5)], None)
    assert len(store.commits) == 2


def test_deferred_records_are_bounded():
    ex, store = _executor()
    for s in range(MAX_DEFERRED + 1):
        ex.perform(None, [step(s)], None)
    assert len(store.commits) == 1 and len(store.commits[0][0]) == MAX_DEFERRED


def test_the_commands_code_files_are_the_snapshots_and_run_from_any_working_directory(tmp_path):
    from stalwart.controller.job.executor import command_in, safe_path_env
    code, snap = tmp_path / "code", tmp_path / "state" / "versions" / "v1"
    (code / ".venv" / "bin").mkdir(parents=True)
    (code / ".venv" / "bin" / "python").write_text("")
    (code / "train.sh").write_text("")
    (code / "only_here.py").write_text("")
    snap.mkdir(parents=True)
    (snap / "train.sh").write_text("")          # (a snapshot holds the code, not the virtualenv)
    (snap / "train.py").write_text("")
    py = [".venv/bin/python", "-m", "stalwart.examples.gpt"]
    assert command_in(py, str(snap), str(code)) == [str(code / ".venv/bin/python"), "-m", "stalwart.examples.gpt"]
    assert command_in(["./train.sh", "--x"], str(snap), str(code)) == [str(snap / "train.sh"), "--x"]  # the version's
    assert command_in(["python", "train.py", "a.py"], str(snap), str(code)) == [
        "python", str(snap / "train.py"), "a.py"]
    assert command_in(["python3", "-u", "-W", "ignore", "only_here.py"], str(snap), str(code)) == [
        "python3", "-u", "-W", "ignore", str(code / "only_here.py")]
    assert command_in(["/usr/bin/python3"], str(snap), str(code)) == ["/usr/bin/python3"]
    assert command_in(["python", "-c", "x.py"], str(snap), str(code)) == ["python", "-c", "x.py"]
    assert command_in(["python", "train.py"], None, str(code)) == ["python", str(code / "train.py")]
    # `-m` outside the snapshot: the working directory is left off sys.path (the snapshot's module wins)
    assert safe_path_env(py, str(code), str(snap)) == {"PYTHONSAFEPATH": "1"}
    assert safe_path_env(py, str(snap), str(snap)) == {}
    assert safe_path_env(["python", "train.py"], str(code), str(snap)) == {}
